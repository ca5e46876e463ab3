"""Spreading: the cost model gives streams to the equations nobody placed.

A list scheduler over the equations in program order, with the cost model:
each unplaced equation goes to the stream where it would finish earliest,
counting the event a cross-stream input costs and the launch of a new region
when it leaves its main input's stream. Ties keep it on the stream of its
latest-finishing input, so chains stay together (Opara's "inheritance"), and
an equation cheaper than an event never gets a stream of its own: it
inherits. Placed equations (user, colocate, body, file, forward, effects)
are never moved; the scheduler only plans around them.

Unlike a minimum path cover (Nimble), which splits every independent branch,
this uses the estimates: a branch moves to another stream only when that
shortens the estimated schedule, and the caller compares the resulting plan
against one where unplaced equations stay on the main stream, refusing the
split when the estimated gain does not cover its launches and events.
"""

from __future__ import annotations

from typing import Sequence

from jaxstreams.assign.cost import DeviceModel
from jaxstreams.tag.read import ExposedProgram


def spread_assign(program: ExposedProgram, fixed: Sequence[int | None],
                  streams: int, seconds: Sequence[float],
                  device: DeviceModel,
                  main_for_collectives_until: int | None = None) -> list[int]:
  """A stream for every equation: ``fixed[i]`` where given, chosen otherwise.
  With ``main_for_collectives_until``, equations before that one (the last
  collective) that get a stream of their own do not take the main stream,
  which the collectives before it need free.

  Equations cheaper than an event are followers: they take no stream time
  in the simulation and go where their inputs are (to the main stream when
  their inputs come from several streams), or, with no computed inputs,
  where their first consumer goes (so ``x * 2`` feeding a branch moves with
  the branch instead of queueing on the main stream).
  """
  stream_of: list[int | None] = []
  finish: list[float] = []
  ready = [0.0] * streams

  def arrival(p: int, stream: int) -> float:
    if stream_of[p] is None or stream_of[p] == stream:
      return finish[p]
    return finish[p] + device.event_s

  for index, made_by in enumerate(program.sources):
    preds = sorted(set(made_by))
    placed = [p for p in preds if stream_of[p] is not None]
    # The input that arrives last decides where the equation "continues".
    main_pred = max(placed, key=lambda p: (finish[p], p)) if placed else None
    home = stream_of[main_pred] if main_pred is not None else 0
    duration = seconds[index]
    follower = (fixed[index] is None
                and (duration < device.event_s or streams == 1))
    if follower:
      # A cheap join of several streams goes to the main stream, whose
      # equations are inline: put in a branch's region it would make the
      # whole call wait for the other branches.
      sources = {stream_of[p] for p in placed}
      choice = (home if len(sources) == 1 else 0) if placed or streams == 1 \
          else None
      finish.append(max((arrival(p, home) for p in preds), default=0.0)
                    + duration)
      stream_of.append(choice)
    else:
      if fixed[index] is not None:
        choice = fixed[index]
      else:
        choice, best = home, None
        allowed = [home] + [s for s in range(streams) if s != home]
        if (main_for_collectives_until is not None
            and index < main_for_collectives_until):
          allowed = [s for s in allowed if s != 0]
        for stream in allowed:
          start = max([ready[stream]] + [arrival(p, stream) for p in preds])
          if stream != home:
            start += device.region_launch_s
          if best is None or start + duration < best - 1e-12:
            choice, best = stream, start + duration
      start = max([ready[choice]] + [arrival(p, choice) for p in preds])
      finish.append(start + duration)
      stream_of.append(choice)
      ready[choice] = finish[-1]
      for p in preds:
        _adopt(p, choice, stream_of, program)
  return [0 if s is None else s for s in stream_of]


def _adopt(index: int, stream: int, stream_of, program) -> None:
  """An undecided follower (and its undecided inputs) joins ``stream``."""
  todo = [index]
  while todo:
    i = todo.pop()
    if stream_of[i] is not None:
      continue
    stream_of[i] = stream
    todo += program.sources[i]
