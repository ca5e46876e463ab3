"""The planning pipeline on one traced program: tag, assign, partition.

Kept apart from ``_jit.py`` so the stages can be driven without jax.jit
(benchmarks of planning time, tests). Its result, a ``PartitionedProgram``,
is what lowering emits; ``jaxstreams.partition.report`` makes the user's
``StreamPlan`` from it.
"""

from __future__ import annotations

import dataclasses
import gc

from jaxstreams import _compat, config
from jaxstreams.assign import (DEFAULT_DEVICE, DeviceModel, Placement,
                               StreamRules, assign_streams, equation_cost,
                               load_rules, spread_assign)
from jaxstreams.lower.decide import decide, groups_apart
from jaxstreams.partition import PartitionedProgram, partition
from jaxstreams.partition.schedule import estimate
from jaxstreams.tag import expose_tags

# A split must beat the unsplit plan by this share of its estimated time:
# the estimates are rough, and a marginal gain is not worth two programs'
# worth of events and launches.
MIN_RELATIVE_GAIN = 0.02


@dataclasses.dataclass(frozen=True)
class PlanOptions:
  """The settings one plan is made with (see ``jaxstreams.config``). Here,
  not in a stage: each stage takes only the fields it needs (assignment the
  rules and forward propagation; scheduling the device model; the report
  ``reduce_stream_wait``), and this module hands them out."""
  spread: bool = False
  forward_propagation: bool = False
  rules: StreamRules | None = None
  reduce_stream_wait: bool = True
  device: DeviceModel = DEFAULT_DEVICE


def options_from_config(spread: bool | None = None) -> PlanOptions:
  """PlanOptions from the jaxstreams_* options in force (``spread``
  overrides)."""
  path = config.read("jaxstreams_stream_from_file")
  return PlanOptions(
      spread=config.read("jaxstreams_spread") if spread is None else spread,
      forward_propagation=config.read("jaxstreams_forward_propagation"),
      rules=load_rules(path) if path else None,
      reduce_stream_wait=config.read("jaxstreams_reduce_stream_wait"))


def plan_program(closed_jaxpr, streams: int, source: str, function_name: str,
                 options: PlanOptions = PlanOptions()) -> PartitionedProgram:
  """Plan a traced program. Python's cyclic garbage collector is paused
  meanwhile: planning allocates many small objects and frees none in cycles,
  and full collections over a large traced program made planning time grow
  faster than the program."""
  collecting = gc.isenabled()
  gc.disable()
  try:
    return _plan(closed_jaxpr, streams, source, function_name, options)
  finally:
    if collecting:
      gc.enable()


def _plan(closed_jaxpr, streams, source, function_name,
          options: PlanOptions) -> PartitionedProgram:
  program = expose_tags(closed_jaxpr)
  placements = assign_streams(
      program, streams, source, rules=options.rules,
      forward_propagation=options.forward_propagation,
      plan_bodies=options.spread)
  costs = [equation_cost(e) for e in program.jaxpr.eqns]
  seconds = [c.seconds(options.device) for c in costs]
  work = sum(c.work_seconds(options.device) for c in costs)
  graph = partition(program, [p.stream for p in placements])
  schedule = estimate(graph, seconds, options.device, work, program)
  summary = ""
  if options.spread:
    placements, graph, schedule, summary = _try_spread(
        program, placements, graph, schedule, seconds, work, streams, options)
  # A group whose bodies the installed XLA would all run in place gains
  # nothing from one loop: its scans stay apart (lower/decide.py). Once
  # the shard_map bodies are planned, what lowering must decide for this
  # jaxlib is decided, once, and kept in the plan for emission to follow
  # and the report to show.
  graph.loops_apart = groups_apart(program, graph)
  graph.loops = [g for g in graph.loops if g not in graph.loops_apart]
  bodies, placements = {}, list(placements)
  for index, placement in enumerate(placements):
    if placement.rule == "inside":
      eqn = program.jaxpr.eqns[index]
      body = _plan(_compat.shard_map_body(eqn), streams, source,
                   f"{function_name}/{eqn.primitive.name}#{index}", options)
      if body.has_calls:
        bodies[index] = body
      else:   # nothing in it runs off the main stream: it is one equation
        placements[index] = Placement(0, "main")
  planned = PartitionedProgram(
      function_name=function_name, streams=streams, program=program,
      placements=tuple(placements), costs=tuple(costs), graph=graph,
      schedule=schedule, summary=summary,
      reduce_stream_wait=options.reduce_stream_wait, bodies=bodies)
  return dataclasses.replace(planned, decisions=decide(planned))


def _try_spread(program, placements, graph, schedule, seconds, work, streams,
                options):
  """Let the scheduler place the unplaced equations; keep its plan only if
  its estimated step time beats the plan without it by a clear margin."""
  fixed = [None if p.rule == "main" else p.stream for p in placements]
  if streams == 1 or all(f is not None for f in fixed):
    return placements, graph, schedule, (
        "spread: nothing to place" if streams > 1
        else "spread: streams=1, nothing to split")
  # The scheduler places one equation at a time: on the main stream, work
  # can hold back a collective that comes later. Where the program has
  # collectives, it also tries leaving the main stream to them until the
  # last one; the estimates pick.
  tries = [None]
  collectives = [i for i, p in enumerate(placements) if p.rule == "collective"]
  if collectives:
    tries.append(collectives[-1])
  best = None
  for main_for_collectives_until in tries:
    chosen = spread_assign(program, fixed, streams, seconds, options.device,
                           main_for_collectives_until)
    candidate = [p if f is not None else Placement(s, "spread", p.note)
                 for p, f, s in zip(placements, fixed, chosen)]
    candidate_graph = partition(program, [p.stream for p in candidate])
    candidate_schedule = estimate(candidate_graph, seconds, options.device,
                                  work, program)
    if best is None or candidate_schedule.makespan < best[2].makespan:
      best = (candidate, candidate_graph, candidate_schedule)
  spread_placements, spread_graph, spread_schedule = best
  before, after = schedule.makespan, spread_schedule.makespan
  moved = sum(p.rule == "spread" and p.stream != 0 for p in spread_placements)
  figures = (f"estimated {after * 1e6:.1f} us split vs {before * 1e6:.1f} us "
             "with unplaced equations on the main stream")
  if moved and before - after > MIN_RELATIVE_GAIN * before:
    return (spread_placements, spread_graph, spread_schedule,
            f"spread: split pays, {moved} equations moved off the main stream "
            f"({figures})")
  kept = [Placement(0, "spread", p.note) if f is None else p
          for p, f in zip(placements, fixed)]
  return (kept, graph, schedule,
          f"spread: no split pays ({figures}); unplaced equations stay on the "
          "main stream")
