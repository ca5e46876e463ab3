"""ctypes bindings of the libraries' plain C API (ffi/common/capi.h).

The FFI handlers run inside XLA programs; this C API is the control plane
Python drives directly: creating pools and stages, putting host data into a
stage, reading the marker log. Both libraries export the same functions under
their own prefix, so one table binds either.
"""

from __future__ import annotations

import ctypes
import functools

from jaxstreams.runtime import _loader

c_int64 = ctypes.c_int64
c_int32 = ctypes.c_int32
c_char_p = ctypes.c_char_p
P = ctypes.POINTER

# Status codes (enum JaxstreamsStatus).
OK, TIMEOUT, CLOSED, INVALID_ARGUMENT, NOT_FOUND, INTERNAL = range(6)

_ERRLEN = 1024


class MarkerStruct(ctypes.Structure):
  """Mirror of JaxstreamsMarker."""

  _fields_ = [
    ("t_ns", c_int64),
    ("region", c_int64),
    ("phase", c_int32),
    ("track", c_int32),
    ("device", c_int32),
    ("stream", c_int32),
  ]


class StageStatsStruct(ctypes.Structure):
  """Mirror of JaxstreamsStageStats."""

  _fields_ = [
    ("capacity", c_int64),
    ("item_bytes", c_int64),
    ("puts", c_int64),
    ("gets", c_int64),
    ("queued", c_int64),
    ("free_slots", c_int64),
    ("allocations", c_int64),
    ("last_slot", c_int64),
    ("closed", c_int32),
    ("device", c_int32),
  ]


_ERR = [c_char_p, c_int64]
_SIGNATURES = {
  "AbiVersion": (ctypes.c_int, []),
  "FfiApiVersion": (ctypes.c_int, []),
  "PoolCreate": (ctypes.c_int, [c_int64, c_int64, c_int64, *_ERR]),
  "PoolInfo": (ctypes.c_int, [c_int64, P(c_int64), P(c_int64)]),
  "PoolDestroyAll": (None, []),
  "Synchronize": (ctypes.c_int, [c_int64, *_ERR]),
  "StageCreate": (ctypes.c_int, [c_int64, c_int64, c_int64, P(c_int64), *_ERR]),
  "StagePut": (
    ctypes.c_int,
    [c_int64, c_int64, P(ctypes.c_void_p), P(c_int64), c_int64, c_int64, *_ERR],
  ),
  "StageClose": (ctypes.c_int, [c_int64]),
  "StageDestroy": (ctypes.c_int, [c_int64]),
  "StageStats": (ctypes.c_int, [c_int64, P(StageStatsStruct)]),
  "TimelineReset": (ctypes.c_int, [c_int64, c_int64, *_ERR]),
  "TimelineRead": (
    ctypes.c_int,
    [c_int64, P(MarkerStruct), c_int64, P(c_int64), P(c_int64), *_ERR],
  ),
}
assert set(_SIGNATURES) == set(_loader.CAPI_FUNCTIONS)


class RuntimeOpError(RuntimeError):
  """A runtime C API call failed; the message is the library's."""


class StageTimeoutError(RuntimeOpError, TimeoutError):
  """A bounded wait on a stage ran out (e.g. a put into a full stage)."""


class StageClosedError(RuntimeOpError):
  """The stage was closed."""


_STATUS_ERRORS = {TIMEOUT: StageTimeoutError, CLOSED: StageClosedError}


class CApi:
  """Typed calls into one loaded library; raises on a nonzero status."""

  def __init__(self, loaded: _loader.LoadedLibrary):
    self.platform = loaded.platform
    prefix = _loader._PLATFORMS[loaded.platform][2]
    self._fns = {}
    for name, (restype, argtypes) in _SIGNATURES.items():
      fn = getattr(loaded.lib, prefix + name)
      fn.restype = restype
      fn.argtypes = argtypes
      self._fns[name] = fn

  def _call(self, name: str, *args) -> None:
    err = ctypes.create_string_buffer(_ERRLEN)
    status = self._fns[name](*args, err, _ERRLEN)
    if status != OK:
      message = (
        err.value.decode(errors="replace") or f"{name} failed (status {status})"
      )
      raise _STATUS_ERRORS.get(status, RuntimeOpError)(message)

  def ffi_api_version(self) -> int:
    """XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR of the headers built
    with."""
    return self._fns["FfiApiVersion"]()

  # Pools -------------------------------------------------------------------
  def pool_create(self, device: int, streams: int, events: int) -> None:
    self._call("PoolCreate", device, streams, events)

  def pool_info(self, device: int) -> tuple[int, int] | None:
    streams, events = c_int64(), c_int64()
    if self._fns["PoolInfo"](
      device, ctypes.byref(streams), ctypes.byref(events)
    ):
      return streams.value, events.value
    return None

  def pool_destroy_all(self) -> None:
    self._fns["PoolDestroyAll"]()

  def synchronize(self, device: int) -> None:
    self._call("Synchronize", device)

  # Stages ------------------------------------------------------------------
  def stage_create(self, device: int, capacity: int, item_bytes: int) -> int:
    out = c_int64()
    self._call("StageCreate", device, capacity, item_bytes, ctypes.byref(out))
    return out.value

  def stage_put(
    self, stage: int, buffers, timeout_ms: int, delay_us: int
  ) -> None:
    """Copies `buffers` (C-contiguous numpy arrays) into the stage."""
    n = len(buffers)
    ptrs = (ctypes.c_void_p * n)(*[b.ctypes.data for b in buffers])
    sizes = (c_int64 * n)(*[b.nbytes for b in buffers])
    self._call("StagePut", stage, n, ptrs, sizes, timeout_ms, delay_us)

  def stage_close(self, stage: int) -> bool:
    return self._fns["StageClose"](stage) == OK

  def stage_destroy(self, stage: int) -> bool:
    return self._fns["StageDestroy"](stage) == OK

  def stage_stats(self, stage: int) -> StageStatsStruct | None:
    out = StageStatsStruct()
    if self._fns["StageStats"](stage, ctypes.byref(out)) != OK:
      return None
    return out

  # Markers -----------------------------------------------------------------
  def timeline_reset(self, device: int, capacity: int) -> None:
    self._call("TimelineReset", device, capacity)

  def timeline_read(
    self, device: int, max_markers: int
  ) -> tuple[list[MarkerStruct], int]:
    buf = (MarkerStruct * max(max_markers, 1))()
    count, dropped = c_int64(), c_int64()
    self._call(
      "TimelineRead",
      device,
      buf,
      max_markers,
      ctypes.byref(count),
      ctypes.byref(dropped),
    )
    return list(buf[: count.value]), dropped.value


@functools.cache
def capi(platform: str) -> CApi:
  """The C API of `platform`'s library (RuntimeLibraryError if missing)."""
  return CApi(_loader.require(platform))
