"""How ``prefetch`` puts an item on the device, and how the consumer
receives it: a ``Transfer``.

Two transfer paths (``transfer=``; the default, ``"by_platform"``, picks
one by backend from ``BY_PLATFORM_TRANSFER``):

* ``"device_put"``: ``jax.device_put`` (numpy leaves through the call it
  ends in, ``place_on_device``); a worker waits until the copy is done, so an
  item handed out is on the device.
* ``"stage_area"``: the runtime's ``StageArea`` (``jaxstreams.runtime``) with
  ``size`` slots. The first item whose leaves are all numpy arrays fixes the
  structure, shapes and dtypes (dtypes as ``jax.device_put`` would make them:
  float64 becomes float32 without x64) and creates the area. A worker
  ``put()``s each item (on a GPU: into a pinned host slot, then a copy into
  the slot's device buffer on the runtime's copy stream, with a ready event
  per slot; on CPU the CPU runtime's host slots and copy worker); the
  consumer takes it out with a small jitted function, cached per area, that
  calls ``get()`` and returns device arrays. Puts are made in item order
  (a ticket per item, taken when it is pulled), because the area is a FIFO
  and ``get()`` takes the oldest item. An item that does not fit (another
  structure, shape or dtype, or a leaf that is not a numpy array: a Python
  scalar, an array already on a device) is placed with ``jax.device_put``
  instead, in its place in the order, and counted in ``Prefetcher.placed``.
  ``close()`` (and collection, and the end) closes the area, joins the
  workers, waits for the gets already dispatched and destroys the area.

``place_on_device`` is also what ``staged``'s reader places batches with.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import jax
import numpy as np

from jaxstreams import _compat

TRANSFERS = ("by_platform", "device_put", "stage_area")

# What transfer="by_platform" picks, by jax.default_backend(): a table, read
# at run time without measuring anything, from the figures of
# benchmarks/prefetch.py (benchmarks/results/prefetch_<backend>.json).
# CPU: measured; see the "transfer" case there. GPU: measured on an H100 with
# jax 0.11.2 (benchmarks/results/gpu/prefetch_gpu.txt): jax.device_put placed
# 0.25 MiB items faster than the stage area's copy stream (2560 against 2155
# items/s) and 4 MiB items faster over a 100-item run (926 against 779; once
# started the stage area was faster, 1201 against 929, but its first item
# took 46 ms). Other backends have no runtime library: device_put.
BY_PLATFORM_TRANSFER = {"cpu": "device_put", "gpu": "device_put"}

# A get is only dispatched for an item already put, so it never waits for a
# producer; the bound only turns a runtime bug into an error, not a hang.
_GET_TIMEOUT_MS = 60_000


class Transfer:
  """How an item is placed and how the consumer receives it.

  ``place(ticket, item, wait)`` runs in a worker, or in the consumer when
  items are produced inline (tickets are 0, 1, 2... in pull order, one per
  item pulled; ``wait``: return only once the copies are done, as a worker
  does so that an item handed out is on the device and the lookahead bound
  counts device memory); ``deliver(value)``, where a transfer has one,
  runs in the consumer, under the pipeline's lock, in item order, with what
  ``place`` returned (None: the consumer receives that itself, with no
  call per item); ``stop()`` may run on any thread and only signals;
  ``release()`` runs once, when no worker is left and nothing more will be
  delivered."""

  name = "custom"
  deliver: Callable[[Any], Any] | None = None

  def place(self, ticket: int, item: Any, wait: bool) -> Any:
    raise NotImplementedError

  def stop(self) -> None:
    pass

  def release(self) -> None:
    pass

  def counts(self, placed: int) -> dict[str, int]:
    """``Prefetcher.placed``, given how many items were placed."""
    return {}

  def shares_cores(self) -> bool:
    """Whether the device items go to computes on the host's own cores
    (XLA:CPU), so producing items there competes with the step."""
    return jax.default_backend() == "cpu"


class FunctionTransfer(Transfer):
  """A plain function of the item (``Prefetcher(transform=...)``)."""

  def __init__(self, transform: Callable[[Any], Any]):
    self.transform = transform

  def place(self, ticket: int, item: Any, wait: bool) -> Any:
    return self.transform(item)


def _host_arrays(item: Any) -> Any:
  """``item`` with its leaves on jax's default device, when every leaf is
  a numpy array (or scalar) of a canonical device dtype; else None. Through
  ``_compat.host_array_to_device``: jax.device_put's own last call, about a
  sixth of its cost on a small array (and copied, so the producer may reuse
  its numpy buffers)."""
  if type(item) is np.ndarray:     # the common item, without a tree walk
    return _compat.host_array_to_device(item, _canonical)
  leaves, treedef = jax.tree_util.tree_flatten(item)
  if not leaves:
    return None
  placed = []
  for leaf in leaves:
    if type(leaf) is not np.ndarray:
      if not isinstance(leaf, (np.ndarray, np.generic)):
        return None     # a Python scalar (weakly typed), a jax array, ...
      leaf = np.asarray(leaf)
    array = _compat.host_array_to_device(leaf, _canonical)
    if array is None:
      return None
    placed.append(array)
  return treedef.unflatten(placed)


def _canonical(dtype: np.dtype) -> bool:
  """Whether arrays of ``dtype`` go to the device unchanged: a device dtype
  that jax does not convert (float64 without x64 becomes float32)."""
  if not dtype.isnative or (dtype.kind not in "biufc"
                            and dtype.name not in _EXTRA_DTYPES):
    return False      # (jax refuses big-endian arrays; it reads no bytes)
  return jax.dtypes.canonicalize_dtype(dtype) == dtype


def place_on_device(item: Any, sharding: Any = None, wait: bool = True) -> Any:
  """``jax.device_put(item, sharding)``: the same arrays, bit for bit, with
  the same dtypes, weak types and devices; numpy leaves placed on the
  default device cheaply (``_host_arrays``). With ``wait``, returns once
  the copies are done. Used by prefetch and by staged's reader."""
  out = _host_arrays(item) if sharding is None else None
  if out is None:
    out = jax.device_put(item, sharding)
  if wait:
    if type(out) is _compat.ARRAY_TYPE:
      out.block_until_ready()     # one array: no tree walk
    else:
      jax.block_until_ready(out)
  return out


class _DevicePutTransfer(Transfer):
  name = "device_put"

  def __init__(self, sharding: Any):
    self.sharding = sharding

  def place(self, ticket: int, item: Any, wait: bool) -> Any:
    return place_on_device(item, self.sharding, wait)

  def shares_cores(self) -> bool:
    if self.sharding is None:
      return super().shares_cores()
    try:
      leaves = jax.tree_util.tree_leaves(self.sharding)
      return all(device.platform == "cpu" for leaf in leaves
                 for device in getattr(leaf, "device_set", (leaf,)))
    except AttributeError:    # not a sharding or device: device_put says so
      return super().shares_cores()

  def counts(self, placed: int) -> dict[str, int]:
    return {"device_put": placed, "stage_area": 0}


class _InStage:
  """What a worker hands the consumer for an item waiting in the stage area:
  its structure (the area holds the flat leaves)."""
  __slots__ = ("treedef",)

  def __init__(self, treedef: Any):
    self.treedef = treedef


def _stageable_leaves(item: Any) -> tuple[Any, list[np.ndarray]] | None:
  """(treedef, leaves as the numpy arrays ``jax.device_put`` would copy), or
  None when a leaf is not a numpy array of a dtype a device holds."""
  leaves, treedef = jax.tree_util.tree_flatten(item)
  if not leaves:
    return None
  arrays = []
  for leaf in leaves:
    # Python scalars become weakly typed arrays under device_put, jax arrays
    # are already placed: neither goes through the area.
    if not isinstance(leaf, (np.ndarray, np.generic)):
      return None
    dtype = leaf.dtype
    if not dtype.isnative or (dtype.kind not in "biufc"
                              and dtype.name not in _EXTRA_DTYPES):
      return None     # device_put refuses a big-endian array: so do we
    try:
      canonical = jax.dtypes.canonicalize_dtype(dtype)
    except (TypeError, ValueError):
      return None
    # The same conversion device_put makes (float64 -> float32 without x64).
    arrays.append(np.asarray(leaf, dtype=canonical, order="C"))
  return treedef, arrays


# ml_dtypes' types have numpy kind "V"; they are ordinary device dtypes.
_EXTRA_DTYPES = frozenset({
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e3m4", "float8_e4m3",
    "float8_e8m0fnu", "int4", "uint4", "int2", "uint2", "float4_e2m1fn"})


class _StageAreaTransfer(Transfer):
  """Items through a ``jaxstreams.runtime.StageArea`` of ``size`` slots."""

  name = "stage_area"

  def __init__(self, size: int, platform: str):
    self.size = size
    self.platform = platform
    self.cond = threading.Condition()
    self.turn = 0               # the ticket whose turn it is to put
    self.stopped = False
    self.area = None            # created by the first item that fits
    self.spec = None            # ((shape, dtype), ...) of its leaves
    self.treedef = None
    self.getter = None
    self.pending = collections.deque()   # gets dispatched, maybe not run yet
    self.staged = 0
    self.fallbacks = 0

  # Worker side -----------------------------------------------------------------
  def place(self, ticket: int, item: Any, wait: bool) -> Any:
    with self.cond:
      while self.turn != ticket and not self.stopped:
        self.cond.wait()
      if self.stopped:
        raise _Stopped
    fits = False
    try:
      flat = _stageable_leaves(item)
      if flat is not None:
        treedef, arrays = flat
        spec = tuple((a.shape, a.dtype) for a in arrays)
        if self.area is None and sum(a.nbytes for a in arrays) > 0:
          self._create(spec, treedef)
        fits = self.area is not None and spec == self.spec and (
            treedef == self.treedef)
      if fits:
        # Blocks while the area is full (a get dispatched but not yet run);
        # stop() closes the area, which ends the wait with StageClosedError.
        self.area.put(arrays)
        with self.cond:
          self.staged += 1
        return _InStage(treedef)
    finally:
      with self.cond:
        self.turn += 1          # the next ticket may put now
        self.cond.notify_all()
    out = place_on_device(item, None, wait)
    with self.cond:
      self.fallbacks += 1
    return out

  def _create(self, spec, treedef) -> None:
    from jaxstreams import runtime   # pylint: disable=import-outside-toplevel
    with self.cond:
      if self.stopped:
        raise _Stopped
      self.area = runtime.StageArea(
          [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in spec],
          capacity=self.size, platform=self.platform)
      self.spec, self.treedef = spec, treedef
      area = self.area
      # One small program per area: the area's id is an attribute of the
      # custom call. The extra scalar is written by the same execution; the
      # consumer keeps it to know when the get has run (the arrays handed out
      # may be donated or deleted by then).
      self.getter = jax.jit(lambda: (area.get(timeout_ms=_GET_TIMEOUT_MS),
                                     jax.numpy.zeros((), jax.numpy.int32)))

  # Consumer side ---------------------------------------------------------------
  def deliver(self, value: Any) -> Any:
    if not isinstance(value, _InStage):
      return value              # placed with device_put
    leaves, done = self.getter()
    while self.pending and self.pending[0].is_ready():
      self.pending.popleft()
    self.pending.append(done)
    return value.treedef.unflatten(leaves)

  # Lifetime ----------------------------------------------------------------------
  def stop(self) -> None:
    with self.cond:
      self.stopped = True
      self.cond.notify_all()
      area = self.area
    if area is not None:
      area.close()              # a put waiting for a free slot fails now

  def release(self) -> None:
    with self.cond:
      self.stopped = True
      self.cond.notify_all()
      area = self.area          # kept, destroyed: stats() says so
      pending, self.pending = list(self.pending), collections.deque()
    if area is None:
      return
    # A get dispatched but not yet run would find no area: wait for them.
    for done in pending:
      try:
        done.block_until_ready()
      except Exception:  # noqa: BLE001 - its error went to the item's user
        pass
    area.destroy()

  def counts(self, placed: int) -> dict[str, int]:
    with self.cond:
      return {"device_put": self.fallbacks, "stage_area": self.staged}


class _Stopped(Exception):
  """The pipeline stopped while a worker waited for its turn to put."""


def _stage_platform(sharding: Any) -> tuple[str | None, str]:
  """The runtime platform a stage area would use, or None and why not."""
  if sharding is not None:
    return None, ("it places items on jax's default device only, and "
                  f"sharding={sharding!r} was given")
  backend = jax.default_backend()
  platform = {"cpu": "cpu", "gpu": "cuda"}.get(backend)
  if platform is None:
    return None, f"the native runtime has no {backend!r} implementation"
  try:
    from jaxstreams import runtime   # pylint: disable=import-outside-toplevel
    available = runtime.available_platforms()
  except Exception as e:  # noqa: BLE001 - reported in the message
    return None, f"the native runtime could not be loaded ({e})"
  if platform not in available:
    return None, (f"the runtime library for {platform!r} is not built or not "
                  f"found (loaded: {list(available)}; set "
                  f"{runtime.ENV_LIB_DIR} to a build's lib/ directory)")
  return platform, ""


def resolve(transfer: Any, sharding: Any, size: int, func: str) -> Transfer:
  """The ``Transfer`` for ``prefetch(transfer=...)``; a ValueError naming
  the value, or why ``"stage_area"`` cannot be used here."""
  if not isinstance(transfer, str) or transfer not in TRANSFERS:
    raise ValueError(f"{func}: transfer must be one of {list(TRANSFERS)}, got "
                     f"{transfer!r}")
  if transfer == "by_platform":
    transfer = BY_PLATFORM_TRANSFER.get(jax.default_backend(), "device_put")
    if transfer == "stage_area" and _stage_platform(sharding)[0] is None:
      transfer = "device_put"
  if transfer == "device_put":
    return _DevicePutTransfer(sharding)
  platform, why_not = _stage_platform(sharding)
  if platform is None:
    raise ValueError(f"{func}: transfer='stage_area' cannot be used here: "
                     f"{why_not}. Use transfer='device_put' or 'by_platform'.")
  return _StageAreaTransfer(size, platform)


