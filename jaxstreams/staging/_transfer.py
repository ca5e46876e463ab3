"""How ``prefetch`` puts an item on the device and hands it to the
consumer: a ``Transfer`` per path of ``prefetch(transfer=...)``.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jaxstreams import _compat

TRANSFERS = ("by_platform", "device_put", "stage_area")

# What transfer="by_platform" picks, by jax.default_backend(): the path
# benchmarks/prefetch.py measured faster there; elsewhere device_put.
BY_PLATFORM_TRANSFER = {"cpu": "device_put", "gpu": "device_put"}

# A get follows its put: the bound only turns a runtime bug into an error.
_GET_TIMEOUT_MS = 60_000


class Transfer:
  """``place(ticket, item, wait)`` runs in a worker or inline (tickets
  number pulled items in order; ``wait``: until the copies are done);
  ``deliver(value)``, if not None, in the consumer, in item order;
  ``stop()`` only signals; ``release()`` runs once no worker is left."""

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
    """Whether the items' device computes on the host's cores (XLA:CPU)."""
    return jax.default_backend() == "cpu"


class FunctionTransfer(Transfer):
  """A plain function of the item (``Prefetcher(transform=...)``)."""

  def __init__(self, transform: Callable[[Any], Any]):
    self.transform = transform

  def place(self, ticket: int, item: Any, wait: bool) -> Any:
    return self.transform(item)


def _device_dtype(dtype: np.dtype) -> np.dtype | None:
  """The dtype ``jax.device_put`` makes of ``dtype`` (float64 becomes
  float32 without x64), or None where it refuses it or it is not numeric
  (jax refuses big-endian arrays)."""
  if not dtype.isnative or (dtype.kind not in "biufc"
                            and dtype.name not in _EXTRA_DTYPES):
    return None
  try:
    return jax.dtypes.canonicalize_dtype(dtype)
  except (TypeError, ValueError):
    return None


def _unchanged(dtype: np.dtype) -> bool:
  return _device_dtype(dtype) == dtype


def _numpy_leaves(item: Any) -> tuple[Any, list] | None:
  """(treedef, leaves) where every leaf is a numpy array or scalar, else
  None (a Python scalar becomes weakly typed, a jax array is placed)."""
  leaves, treedef = jax.tree_util.tree_flatten(item)
  if not leaves or not all(isinstance(leaf, (np.ndarray, np.generic))
                           for leaf in leaves):
    return None
  return treedef, leaves


def _host_arrays(item: Any) -> Any:
  """``item`` on jax's default device through
  ``_compat.host_array_to_device`` (a sixth of ``jax.device_put``'s cost on
  a small array) where every leaf is a numpy array of a dtype that goes to
  the device unchanged; else None."""
  if type(item) is np.ndarray:     # the common item, without a tree walk
    return _compat.host_array_to_device(item, _unchanged)
  flat = _numpy_leaves(item)
  if flat is None:
    return None
  placed = []
  for leaf in flat[1]:
    array = _compat.host_array_to_device(np.asarray(leaf), _unchanged)
    if array is None:
      return None
    placed.append(array)
  return flat[0].unflatten(placed)


def place_on_device(item: Any, sharding: Any = None, wait: bool = True) -> Any:
  """``jax.device_put(item, sharding)``, bit for bit, numpy leaves placed
  cheaply (``_host_arrays``); with ``wait``, once the copies are done."""
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


class _InStage(NamedTuple):
  """An item waiting in the stage area (which holds its leaves)."""
  treedef: Any


def _stageable_leaves(item: Any) -> tuple[Any, list[np.ndarray]] | None:
  """(treedef, leaves as the arrays ``jax.device_put`` would copy), or None
  where a leaf is not a numpy array of a device dtype."""
  flat = _numpy_leaves(item)
  if flat is None:
    return None
  treedef, arrays = flat[0], []
  for leaf in flat[1]:
    dtype = _device_dtype(leaf.dtype)
    if dtype is None:
      return None
    arrays.append(np.asarray(leaf, dtype=dtype, order="C"))
  return treedef, arrays


# ml_dtypes' types have numpy kind "V"; they are ordinary device dtypes.
_EXTRA_DTYPES = frozenset({
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e3m4", "float8_e4m3",
    "float8_e8m0fnu", "int4", "uint4", "int2", "uint2", "float4_e2m1fn"})


class _StageAreaTransfer(Transfer):
  """Items through the runtime's ``StageArea`` of ``size`` slots, whose
  structure, shapes and dtypes the first item of numpy leaves fixes. It is
  a FIFO, so workers put items in ticket order; the consumer takes each
  out with a jitted ``get()``. An item that does not fit is device_put."""

  name = "stage_area"

  def __init__(self, size: int, platform: str):
    self.size = size
    self.platform = platform
    self.cond = threading.Condition()
    self.turn = 0               # the ticket whose turn it is to put
    self.stopped = False
    self.area = None            # created by the first item that fits
    self.spec = None            # (treedef, ((shape, dtype), ...))
    self.getter = None
    self.pending = collections.deque()   # gets dispatched, maybe not run yet
    self.staged = 0
    self.fallbacks = 0

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
        spec = (treedef, tuple((a.shape, a.dtype) for a in arrays))
        if self.area is None and sum(a.nbytes for a in arrays) > 0:
          self._create(spec)
        fits = self.area is not None and spec == self.spec
      if fits:
        # Blocks while the area is full; stop() closes it, ending the wait.
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

  def _create(self, spec) -> None:
    from jaxstreams import runtime   # pylint: disable=import-outside-toplevel
    with self.cond:
      if self.stopped:
        raise _Stopped
      self.area = area = runtime.StageArea(
          [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in spec[1]],
          capacity=self.size, platform=self.platform)
      self.spec = spec
      # One program per area; the scalar tells when the get has run (its
      # arrays may be donated).
      self.getter = jax.jit(lambda: (area.get(timeout_ms=_GET_TIMEOUT_MS),
                                     jax.numpy.zeros((), jax.numpy.int32)))

  def deliver(self, value: Any) -> Any:
    if not isinstance(value, _InStage):
      return value              # placed with device_put
    leaves, done = self.getter()
    while self.pending and self.pending[0].is_ready():
      self.pending.popleft()
    self.pending.append(done)
    return value.treedef.unflatten(leaves)

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


def resolve(transfer: Any, sharding: Any, func: str
            ) -> Callable[[int], Transfer]:
  """What makes ``prefetch(transfer=...)``'s ``Transfer`` from the
  lookahead's size; a ValueError where it cannot be used here."""
  if not isinstance(transfer, str) or transfer not in TRANSFERS:
    raise ValueError(f"{func}: transfer must be one of {list(TRANSFERS)}, got "
                     f"{transfer!r}")
  if transfer == "by_platform":
    transfer = BY_PLATFORM_TRANSFER.get(jax.default_backend(), "device_put")
    if transfer == "stage_area" and _stage_platform(sharding)[0] is None:
      transfer = "device_put"
  if transfer == "device_put":
    return lambda size: _DevicePutTransfer(sharding)
  platform, why_not = _stage_platform(sharding)
  if platform is None:
    raise ValueError(f"{func}: transfer='stage_area' cannot be used here: "
                     f"{why_not}. Use transfer='device_put' or 'by_platform'.")
  return lambda size: _StageAreaTransfer(size, platform)
