"""Stage areas: fixed-capacity slots the runtime owns, filled from the host
and handed to a jitted consumer in put order.

The device side of staging/prefetch (SmartStage, TF staging areas): a
producer thread calls `put` with host arrays; the runtime copies them into a
free slot (pinned host memory on CUDA) and starts the transfer into the
slot's device buffer on its copy stream, then records the slot's ready
event. `get`, inside a jitted step, waits on the host until an item was put,
makes the step's stream wait for that slot's ready event, copies the slot
into the step's buffers and releases the slot. Capacity is fixed at
creation; memory never grows with steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jaxstreams import _checks

from jaxstreams.runtime import _capi, _loader, _ops, _pool

# CUDA stage ids start here so that a CPU stage used in a GPU program (or the
# reverse) is reported as "no stage with id N" rather than hitting another
# stage by accident.
CUDA_STAGE_ID_BASE = 1 << 40


@dataclasses.dataclass(frozen=True)
class StageStats:
  """Counters of a stage area (see JaxstreamsStageStats)."""

  capacity: int
  item_bytes: int
  puts: int
  gets: int
  queued: int
  free_slots: int
  allocations: int
  last_slot: int
  closed: bool
  device: int


def _default_platform() -> str:
  if jax.default_backend() == "gpu" and "cuda" in _loader.available_platforms():
    return "cuda"
  return "cpu"


def _timeout(value: float | None, what: str) -> int:
  """Milliseconds for the runtime, which takes -1 for no bound."""
  ms = _checks.timeout(
    value, name=what, context="jaxstreams stage", unit="ms", zero_ok=True
  )
  return -1 if ms is None else int(ms)


class StageArea:
  """A staging area with `capacity` slots for items shaped like `spec`.

  `spec` is a pytree of arrays or `jax.ShapeDtypeStruct`s describing one
  item. `platform` is "cpu" or "cuda" (default: "cuda" when jax's default
  backend is a GPU and the CUDA library is built); `device` the GPU ordinal.
  `timeout_ms` bounds how long `put` waits for a free slot and `get` for an
  item (None: no bound).
  """

  def __init__(
    self,
    spec: Any,
    capacity: int = 2,
    *,
    platform: str | None = None,
    device: int = 0,
    timeout_ms: float | None = None,
  ):
    leaves, self._treedef = jax.tree_util.tree_flatten(spec)
    if not leaves:
      raise ValueError("jaxstreams stage: the item spec has no arrays")
    self._avals = tuple(
      (tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype))
      for leaf in leaves
    )
    self.item_bytes = sum(
      math.prod(shape) * dtype.itemsize for shape, dtype in self._avals
    )
    if self.item_bytes == 0:
      raise ValueError("jaxstreams stage: an item must have at least one byte")
    if (
      isinstance(capacity, bool)
      or not isinstance(capacity, int)
      or capacity < 1
    ):
      raise ValueError(
        f"jaxstreams stage: capacity must be an int >= 1, got {capacity!r}"
      )
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
      raise ValueError(
        f"jaxstreams stage: device must be a device ordinal (an int "
        f">= 0), got {device!r}"
      )
    self.platform = platform or _default_platform()
    self.device = device
    self.capacity = capacity
    self.timeout_ms = _timeout(timeout_ms, "timeout_ms")
    _pool.config()
    self._api = _capi.capi(self.platform)
    self.id = self._api.stage_create(device, capacity, self.item_bytes)

  # Producer side (host) -----------------------------------------------------
  def put(
    self, item: Any, *, timeout_ms: float | None = None, delay_us: int = 0
  ) -> None:
    """Copies `item` (host arrays matching the spec) into a free slot.

    Returns once the host data was copied into the runtime's memory (the
    caller may reuse its arrays); the transfer to the slot's device buffer
    continues on the copy stream. Raises StageTimeoutError when no slot
    frees up within the timeout, StageClosedError after `close`.
    `delay_us` makes the copy stream slow first (tests of ordering).
    """
    leaves, treedef = jax.tree_util.tree_flatten(item)
    if treedef != self._treedef:
      raise ValueError(
        f"jaxstreams stage {self.id}: the item has structure {treedef}, "
        f"the stage holds items of structure {self._treedef}"
      )
    arrays = []
    for i, (leaf, (shape, dtype)) in enumerate(zip(leaves, self._avals)):
      # order="C", not ascontiguousarray: that one makes a 0-d leaf 1-d.
      a = np.asarray(leaf, order="C")
      if a.shape != shape or a.dtype != dtype:
        raise ValueError(
          f"jaxstreams stage {self.id}: item leaf {i} is "
          f"{a.dtype}{list(a.shape)}, the stage holds {dtype}{list(shape)}"
        )
      arrays.append(a)
    timeout = (
      self.timeout_ms
      if timeout_ms is None
      else _timeout(timeout_ms, "timeout_ms")
    )
    self._api.stage_put(self.id, arrays, timeout, int(delay_us))

  def close(self) -> None:
    """Later puts fail; gets drain what was put, then fail."""
    self._api.stage_close(self.id)

  # Consumer side (traceable) -------------------------------------------------
  def get(self, *, after: Any = None, timeout_ms: float | None = None) -> Any:
    """The oldest item, as arrays shaped like the spec; call it inside a
    jitted step (or eagerly). Each call takes one item.

    XLA may run independent ops in any order, so two gets in one program
    need `after`: a pytree of arrays the get must come after (e.g. the
    previous get's result); they are not read.

    Fails inside the program (an XLA runtime error carrying the runtime's
    message) when the stage is closed and empty, or no item arrives within
    the timeout.
    """
    timeout = (
      self.timeout_ms
      if timeout_ms is None
      else _timeout(timeout_ms, "timeout_ms")
    )
    deps = [jax.numpy.asarray(d) for d in jax.tree_util.tree_leaves(after)]
    outs = _ops.stage_get_p.bind(
      *deps, stage=self.id, timeout_ms=timeout, out_avals=self._avals
    )
    return self._treedef.unflatten(outs)

  # Diagnostics / lifetime ----------------------------------------------------
  def stats(self) -> StageStats:
    raw = self._api.stage_stats(self.id)
    if raw is None:
      raise _capi.RuntimeOpError(f"jaxstreams: stage {self.id} was destroyed")
    return StageStats(
      **{
        f.name: getattr(raw, f.name)
        for f in dataclasses.fields(StageStats)
        if f.name != "closed"
      },
      closed=bool(raw.closed),
    )

  def destroy(self) -> None:
    """Closes the stage and frees its memory once in-flight copies end."""
    self._api.stage_destroy(self.id)

  def __enter__(self) -> StageArea:
    return self

  def __exit__(self, *exc) -> None:
    self.destroy()

  def __repr__(self) -> str:
    return (
      f"StageArea(id={self.id}, platform={self.platform!r}, "
      f"capacity={self.capacity}, item_bytes={self.item_bytes})"
    )
