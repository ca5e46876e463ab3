"""Timing markers and the Chrome-trace / Perfetto timeline built from them.

`marker()` ops record timestamps into a fixed-capacity log in the native
runtime (steady clock on CPU, CUDA events on GPU). After a step, `read()`
collects them, `intervals()` pairs each region's BEGIN with its END, and
`write_chrome_trace()` writes a JSON file that chrome://tracing and
ui.perfetto.dev open, one track (thread row) per stream, so a user can see
whether regions overlapped.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict, deque
from typing import Iterable, Mapping

from jaxstreams.runtime import _capi, _ops, _pool

DEFAULT_CAPACITY = 1 << 16


@dataclasses.dataclass(frozen=True)
class Marker:
  t_ns: int
  region: int
  phase: int  # _ops.BEGIN / END / INSTANT
  track: int
  device: int
  stream: int  # -1: XLA's stream, k: runtime stream k
  platform: str


@dataclasses.dataclass(frozen=True)
class Interval:
  region: int
  track: int
  device: int
  platform: str
  start_ns: int
  end_ns: int

  @property
  def duration_ns(self) -> int:
    return self.end_ns - self.start_ns

  def overlaps(self, other: Interval) -> bool:
    """True when the two intervals share some time (same clock needed:
    same platform and device)."""
    return self.start_ns < other.end_ns and other.start_ns < self.end_ns


@dataclasses.dataclass(frozen=True)
class Timeline:
  markers: tuple[Marker, ...]
  dropped: int  # markers lost because the log was full


def _devices() -> list[tuple[str, int]]:
  cfg = _pool.config()
  return [("cpu", 0)] + [("cuda", d) for d in cfg.gpu_devices]


def reset(capacity: int = DEFAULT_CAPACITY) -> None:
  """Drops all markers and makes room for `capacity` per device. Call it
  before the step to profile, with no step running."""
  if capacity < 0:
    raise ValueError(
      "jaxstreams.runtime.timeline.reset: capacity must be >= 0, got "
      f"{capacity}"
    )
  for platform, device in _devices():
    _capi.capi(platform).timeline_reset(device, capacity)


def read(max_markers: int = DEFAULT_CAPACITY) -> Timeline:
  """Waits until every marker issued so far has a time and returns them,
  ordered by time per device."""
  markers: list[Marker] = []
  dropped = 0
  for platform, device in _devices():
    raw, lost = _capi.capi(platform).timeline_read(device, max_markers)
    dropped += lost
    markers.extend(
      sorted(
        (
          Marker(
            m.t_ns, m.region, m.phase, m.track, m.device, m.stream, platform
          )
          for m in raw
        ),
        key=lambda m: m.t_ns,
      )
    )
  return Timeline(tuple(markers), dropped)


def intervals(markers: Iterable[Marker]) -> list[Interval]:
  """Pairs each BEGIN with the next END of the same region on the same
  track and device; unpaired markers are left out."""
  open_: dict[tuple, deque[Marker]] = defaultdict(deque)
  out: list[Interval] = []
  for m in sorted(markers, key=lambda m: (m.platform, m.device, m.t_ns)):
    key = (m.platform, m.device, m.track, m.region)
    if m.phase == _ops.BEGIN:
      open_[key].append(m)
    elif m.phase == _ops.END and open_[key]:
      b = open_[key].popleft()
      out.append(
        Interval(m.region, m.track, m.device, m.platform, b.t_ns, m.t_ns)
      )
  return sorted(out, key=lambda i: (i.platform, i.device, i.start_ns))


def chrome_trace(
  markers: Iterable[Marker], region_names: Mapping[int, str] | None = None
) -> dict:
  """The Chrome trace-event JSON object: one process per device, one
  thread row per track ("stream N"), an "X" event per region interval and
  an instant event per INSTANT marker. Times in µs from the device's first
  marker."""
  markers = list(markers)
  names = dict(region_names or {})
  devices = sorted({(m.platform, m.device) for m in markers})
  pid = {d: i for i, d in enumerate(devices)}
  t0 = {
    d: min(m.t_ns for m in markers if (m.platform, m.device) == d)
    for d in devices
  }
  events: list[dict] = []
  for d in devices:
    events.append(
      {
        "ph": "M",
        "name": "process_name",
        "pid": pid[d],
        "tid": 0,
        "args": {"name": "cpu" if d[0] == "cpu" else f"{d[0]}:{d[1]}"},
      }
    )
  for d, track in sorted({((m.platform, m.device), m.track) for m in markers}):
    events.append(
      {
        "ph": "M",
        "name": "thread_name",
        "pid": pid[d],
        "tid": track,
        "args": {"name": f"stream {track}"},
      }
    )
  for iv in intervals(markers):
    d = (iv.platform, iv.device)
    events.append(
      {
        "ph": "X",
        "cat": "jaxstreams",
        "name": names.get(iv.region, f"region {iv.region}"),
        "pid": pid[d],
        "tid": iv.track,
        "ts": (iv.start_ns - t0[d]) / 1e3,
        "dur": iv.duration_ns / 1e3,
        "args": {"region": iv.region},
      }
    )
  for m in markers:
    if m.phase == _ops.INSTANT:
      d = (m.platform, m.device)
      events.append(
        {
          "ph": "i",
          "s": "t",
          "cat": "jaxstreams",
          "name": names.get(m.region, f"marker {m.region}"),
          "pid": pid[d],
          "tid": m.track,
          "ts": (m.t_ns - t0[d]) / 1e3,
          "args": {"region": m.region},
        }
      )
  return {
    "traceEvents": events,
    "displayTimeUnit": "ms",
    "otherData": {"generator": "jaxstreams.runtime.timeline"},
  }


def write_chrome_trace(
  path: str | os.PathLike,
  markers: Iterable[Marker] | Timeline,
  region_names: Mapping[int, str] | None = None,
) -> dict:
  """Writes `chrome_trace(...)` to `path` as JSON and returns the object."""
  if isinstance(markers, Timeline):
    markers = markers.markers
  trace = chrome_trace(markers, region_names)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(trace, f, indent=1)
  return trace
