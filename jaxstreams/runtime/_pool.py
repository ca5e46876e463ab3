"""The runtime's per-device pools of streams and events, created once.

Streams and events are created here, from Python, before any program that
uses them runs, so the handlers on the execute path only look them up (no
stream creation or allocation per step). CPU devices share one pool of
in-order worker threads; each local GPU gets its own CUDA streams, a copy
stream and events.
"""

from __future__ import annotations

import dataclasses
import threading

import jax

from jaxstreams.runtime import _capi, _loader

DEFAULT_STREAMS = 4
DEFAULT_EVENTS = 1024
# Markers the log holds per device until timeline.reset() asks for another
# size (on CUDA each is a timing event, created here, off the execute path).
INITIAL_TIMELINE_CAPACITY = 4096


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """What `init` created: the same numbers on every device."""

  streams: int
  events: int
  platforms: tuple[str, ...]
  gpu_devices: tuple[int, ...]


_lock = threading.Lock()
_config: PoolConfig | None = None
_free_events: list[int] = []
_next_event = 0


def _local_gpu_ordinals() -> tuple[int, ...]:
  try:
    devices = jax.local_devices(backend="gpu")
  except RuntimeError:
    return ()
  return tuple(
    sorted(d.local_hardware_id for d in devices if d.platform == "gpu")
  )


def init(streams: int | None = None, events: int | None = None) -> PoolConfig:
  """Creates the runtime pools of every platform whose library loaded.

  `streams` runtime streams (worker threads on CPU, CUDA streams on GPU) and
  `events` events per device. Pools are created once per process: calling
  again with the same numbers (or none) returns the existing config; other
  numbers raise, because programs already lowered refer to stream and event
  ids of the existing pool.
  """
  global _config
  streams = DEFAULT_STREAMS if streams is None else streams
  events = DEFAULT_EVENTS if events is None else events
  for name, value in (("streams", streams), ("events", events)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(
        f"jaxstreams.runtime.init: {name} must be an int >= 1, got {value!r}"
      )
  with _lock:
    if _config is not None:
      if (streams, events) != (_config.streams, _config.events):
        raise ValueError(
          f"jaxstreams.runtime.init: the runtime pools already exist with "
          f"{_config.streams} streams and {_config.events} events; they cannot "
          f"change to {streams} streams and {events} events in this process"
        )
      return _config
    _capi.capi("cpu").pool_create(0, streams, events)
    _capi.capi("cpu").timeline_reset(0, INITIAL_TIMELINE_CAPACITY)
    platforms = ["cpu"]
    gpus: tuple[int, ...] = ()
    if "cuda" in _loader.available_platforms():
      gpus = _local_gpu_ordinals()
      for ordinal in gpus:
        _capi.capi("cuda").pool_create(ordinal, streams, events)
        _capi.capi("cuda").timeline_reset(ordinal, INITIAL_TIMELINE_CAPACITY)
      if gpus:
        platforms.append("cuda")
    _config = PoolConfig(streams, events, tuple(platforms), gpus)
    return _config


def config() -> PoolConfig:
  """The pools' config, creating them with the defaults if needed."""
  return _config if _config is not None else init()


def shutdown() -> None:
  """Drains and joins the CPU workers; `init` may create the pools again.

  Optional: the workers are idle threads that end with the process. CUDA
  pools stay (their streams end with the CUDA context).
  """
  global _config, _next_event
  with _lock:
    if _config is None:
      return
    _capi.capi("cpu").pool_destroy_all()
    _config = None
    _free_events.clear()
    _next_event = 0


def allocate_event() -> int:
  """An event id no other caller holds, until `release_event`."""
  global _next_event
  cfg = config()
  with _lock:
    if _free_events:
      return _free_events.pop()
    if _next_event >= cfg.events:
      raise RuntimeError(
        f"jaxstreams: all {cfg.events} runtime events are allocated; release "
        f"some or call jaxstreams.runtime.init(events=...) with more before "
        f"first use"
      )
    _next_event += 1
    return _next_event - 1


def release_event(event: int) -> None:
  """Returns an id from `allocate_event`."""
  with _lock:
    if event not in _free_events:
      _free_events.append(event)


def synchronize() -> None:
  """Blocks until everything queued on the runtime's own streams has run."""
  cfg = config()
  _capi.capi("cpu").synchronize(0)
  for ordinal in cfg.gpu_devices:
    _capi.capi("cuda").synchronize(ordinal)
