"""Estimated schedule of a region graph: when each region would start and end.

Streams run their regions in plan order; a region starts when its stream is
free and its inputs are there (plus an event for each input from another
stream); a region on another stream adds a call launch. No schedule beats
the total work done with the whole GPU, so the estimate is at least that.
Used to decide whether spreading (``jaxstreams.jit(spread=True)``) pays, and
shown by ``str(plan)`` and ``plan.to_perfetto()``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxstreams.assign.cost import DeviceModel
from jaxstreams.partition.regions import RegionGraph


@dataclasses.dataclass(frozen=True)
class Schedule:
  start: tuple[float, ...]          # seconds, per region
  end: tuple[float, ...]
  makespan: float                   # estimated step time with these regions
  single_stream: float              # estimated step time on one stream
  critical_path: tuple[int, ...]    # regions, first to last


def estimate(graph: RegionGraph, seconds: Sequence[float],
             device: DeviceModel, work_seconds: float = 0.0,
             program=None) -> Schedule:
  """``seconds``: each equation's time on its stream; ``work_seconds``: the
  total work with the whole GPU (a lower bound on any schedule).

  A region off the main stream is a call: it starts when all its inputs are
  there. Main-stream equations are emitted inline, so, given the
  ``program`` (an ``ExposedProgram``), each of them starts as soon as its
  own inputs are there, and a call reading one of them waits for that
  equation, not for the rest of its region (XLA starts a call as early as
  its operands allow).
  """
  count = len(graph.streams)
  preds: list[set[int]] = [set() for _ in range(count)]
  for a, b in graph.edges:
    preds[b].add(a)
  eqn_end: dict[int, float] = {}
  start = [0.0] * count
  end = [0.0] * count
  cause: list[int | None] = [None] * count
  free: dict[int, tuple[float, int | None]] = {}

  def arrival(p_region: int, stream: int) -> float:
    return end[p_region] + (device.event_s
                            if graph.streams[p_region] != stream else 0.0)

  for region in range(count):      # regions are numbered in plan order
    stream = graph.streams[region]
    begin, why = free.get(stream, (0.0, None))
    if stream == 0 and program is not None:
      clock, first = begin, None
      for i in graph.members[region]:
        at = clock
        for p in program.sources[i]:
          p_region = graph.region_of[p]
          ready = eqn_end[p] if p_region == region else arrival(p_region, 0)
          if ready > at:
            at = ready
            if p_region != region:
              why = p_region
        first = at if first is None else first
        clock = eqn_end[i] = at + seconds[i]
      start[region] = begin if first is None else first
      end[region] = clock
    else:
      for p in preds[region]:
        if graph.streams[p] == 0 and program is not None:
          continue   # inline: its values arrive one by one (below)
        if arrival(p, stream) > begin:
          begin, why = arrival(p, stream), p
      if program is not None:
        for var in graph.inputs[region]:
          i = program.producer_of(var)
          if i is None or graph.streams[graph.region_of[i]] != 0:
            continue
          ready = eqn_end[i] + (device.event_s if stream != 0 else 0.0)
          if ready > begin:
            begin, why = ready, graph.region_of[i]
      launch = device.region_launch_s if stream != 0 else 0.0
      start[region] = begin
      end[region] = (begin + launch
                     + sum(seconds[i] for i in graph.members[region]))
      for i in graph.members[region]:
        eqn_end[i] = end[region]
    cause[region] = why
    free[stream] = (end[region], region)
  makespan = max(max(end, default=0.0), work_seconds)
  path, seen = [], set()
  node = max(range(count), key=end.__getitem__) if count else None
  while node is not None and node not in seen:
    path.append(node)
    seen.add(node)
    node = cause[node]
  single = max(sum(seconds), work_seconds)
  return Schedule(tuple(start), tuple(end), makespan, single,
                  tuple(reversed(path)))
