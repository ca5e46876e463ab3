"""What lowering decides before it emits anything, once per planned program.

What the installed XLA compiles inside a stream call (``limits``) settles
how a program is emitted: which off-main regions run in place instead of
as calls, and, for each group of independent scans that runs as one loop
(``partition.loops``), which bodies run in place in the loop's step and
which run part of themselves after their call. The pipeline asks here
once, after partitioning, and keeps the answers in the plan
(``PartitionedProgram.decisions``): ``emit`` and ``loops`` turn them into
the program without asking again, and the user's ``StreamPlan`` shows them.
The groups whose bodies would all run in place are left apart
(``groups_apart``), before the decisions are made for those kept.

Here too the program is cut into the functions emission binds: each
region whole, each main-stream equation alone where regions may be
emitted equation by equation, each loop body (and, where part of it runs
after its call, its head and its tail), each on the XLA stream its calls
run on. Emission binds them and cuts nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.extend.core as jcore

from jaxstreams import _compat
from jaxstreams.lower.calls import xla_stream
from jaxstreams.lower.limits import (body_hazard, carry_hazard, carry_tail,
                                     regions_in_place, without_cse_barriers)
from jaxstreams.lower.order import (collective_waits, combiner_keys, emitted,
                                    packed_for_collectives)
from jaxstreams.lower.packing import Packing
from jaxstreams.partition.cut import part_jaxpr
from jaxstreams.partition.loops import layout, loop_length
from jaxstreams.partition.partitioned import (BodyTail, Decisions, LoopBody,
                                              LoopPlan, PartitionedProgram)
from jaxstreams.runtime import _loader
from jaxstreams.tag.read import primitives


def decide(plan: PartitionedProgram) -> Decisions:
  """The decisions for ``plan`` (its region graph's groups of loops final,
  its ``shard_map`` bodies planned): every off-main region the installed
  XLA cannot compile as a stream call, and why, how each group runs as one
  loop, the functions emission binds, and, for the programs of stream
  calls, which regions are left out, the collectives' combiner keys and
  the calls that return packed for them (``lower/order.py``)."""
  program, graph = plan.program, plan.graph
  eqns = program.jaxpr.eqns
  holds = lambda i: primitives([eqns[k] for k in graph.members[i]])
  calls = any(stream != 0 for stream in graph.streams)
  waits = collective_waits(plan) if calls else {}
  keys = combiner_keys(waits)
  return Decisions(
      in_place=regions_in_place(graph.streams, holds, ()),
      loops=tuple(_loop_plan(program, graph, group) for group in graph.loops),
      regions=tuple(
          part_jaxpr(graph.inputs[r], graph.outputs[r],
                     [eqns[i] for i in graph.members[r]])
          for r in range(len(graph.streams))),
      equations={i: equation_jaxpr(eqns[i])
                 for i in _bound_one_by_one(plan, calls, keys)},
      xla_streams=tuple(0 if stream == 0 else xla_stream(graph.streams, stream)
                        for stream in graph.streams),
      bodies_out_of_graphs={"cpu", "cuda"} <= set(
          _loader.available_platforms()) if graph.loops else False,
      unread=frozenset(r for r in range(len(graph.streams))
                       if not emitted(plan, r)),
      combiner_keys=keys,
      collective_packings=(packed_for_collectives(plan, waits)
                           if _compat.XLA_SCHEDULES_STREAM_CALLS else {}))


def _bound_one_by_one(plan: PartitionedProgram, calls: bool,
                      keys: dict[int, str]) -> list[int]:
  """The main-stream equations emission may bind one by one: every one
  where the sequence points may order them (stream calls, on the XLA that
  does not schedule them itself), else those of the main-stream regions
  holding a keyed collective or a planned ``shard_map`` body."""
  graph = plan.graph
  main = [r for r, stream in enumerate(graph.streams) if stream == 0]
  if calls and not _compat.XLA_SCHEDULES_STREAM_CALLS:
    return [i for r in main for i in graph.members[r]]
  return [i for r in main
          if any(i in keys or i in plan.bodies for i in graph.members[r])
          for i in graph.members[r]]


def equation_jaxpr(eqn) -> jcore.ClosedJaxpr:
  """``eqn`` alone as a closed jaxpr of the values it reads (each once,
  first read first) returning its results."""
  reads = dict.fromkeys(v for v in eqn.invars
                        if not isinstance(v, jcore.Literal))
  return part_jaxpr(reads, eqn.outvars, [eqn])


def _loop_plan(program, graph, regions) -> LoopPlan:
  eqns = [program.jaxpr.eqns[graph.members[r][0]] for r in regions]
  lengths = tuple(loop_length(eqn) for eqn in eqns)
  return LoopPlan(
      tuple(regions), bool(eqns[0].params["reverse"]), lengths,
      layout(lengths),
      tuple(_cut_body(eqn, loop_body(eqn, r, graph.streams[r]),
                      graph.streams[r])
            for eqn, r in zip(eqns, regions)))


def _cut_body(eqn, body: LoopBody, stream: int) -> LoopBody:
  """``body`` (of the scan ``eqn``, on ``stream``) with the functions it is
  emitted as, and the dtype its call's results are packed in
  (``LoopBody``)."""
  inner = body.body.jaxpr
  operands = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
  split = (_cut_tail(inner, body.eqns, body.tail, body.num_consts,
                     body.num_carry) if body.tail else None)
  called = (split.head if split else body.body).jaxpr.outvars
  packing = (Packing.of(called) if stream != 0 and body.in_place is None
             and _compat.MULTI_RESULT_CALLS_RUN_IN_TURN
             and not _compat.XLA_SCHEDULES_STREAM_CALLS else None)
  return dataclasses.replace(
      body,
      function=part_jaxpr([*inner.constvars, *inner.invars], inner.outvars,
                          body.eqns),
      split=split, scan=part_jaxpr(operands, eqn.outvars, [eqn]),
      packed_as=None if packing is None else packing.carrier)


def _cut_tail(jaxpr, eqns, positions, num_consts: int, num_carry: int
              ) -> BodyTail:
  """A body (``jaxpr``, its equations as emitted ``eqns``) cut so that the
  equations at ``positions`` run after the rest (``BodyTail``)."""
  moved = set(positions)
  head = [e for i, e in enumerate(eqns) if i not in moved]
  tail = [eqns[i] for i in positions]
  made_by_tail = {v for e in tail for v in e.outvars}
  before = ({v for e in head for v in e.outvars}
            | set(jaxpr.invars[num_consts:num_consts + num_carry]))
  needed = list(dict.fromkeys(
      v for e in tail for v in e.invars
      if not isinstance(v, jcore.Literal) and v in before))
  ys = jaxpr.outvars[num_carry:]
  from_tail = tuple(not isinstance(v, jcore.Literal) and v in made_by_tail
                    for v in ys)
  head_ys = [v for v, later in zip(ys, from_tail) if not later]
  fixed = [*jaxpr.constvars, *jaxpr.invars[:num_consts]]
  return BodyTail(
      head=part_jaxpr([*jaxpr.constvars, *jaxpr.invars],
                      [*jaxpr.outvars[:num_carry], *head_ys, *needed], head),
      tail=part_jaxpr([*fixed, *jaxpr.invars[num_consts + num_carry:],
                       *needed],
                      [v for v, later in zip(ys, from_tail) if later], tail),
      from_tail=from_tail, num_fixed=len(fixed), num_carry=num_carry,
      num_head_ys=len(head_ys),
      num_needed=len(needed))


def loop_body(eqn, region: int, stream: int) -> LoopBody:
  """For the body of ``eqn`` (the scan of ``region``, on ``stream``) as a
  stream call per step of its group's one loop: the body and its
  equations as emitted, why it runs in place instead (the main stream's
  body runs in place anyway), the positions of its equations that run
  after its call (``limits.carry_tail``), where those make the rest one,
  and why XLA cannot compile it whole."""
  closed = _compat.nested_jaxpr({"jaxpr": eqn.params["jaxpr"]})
  body = closed.jaxpr
  num_consts, num_carry = _compat.scan_counts(eqn.params)
  decided = functools.partial(
      LoopBody, region, closed, tuple(without_cse_barriers(body.eqns)),
      num_consts, num_carry)
  if stream == 0:
    return decided()
  why = body_hazard(body.eqns)
  if why is not None:
    return decided(why, (), why)
  why = carry_hazard(body, num_consts, num_carry)
  if why is None:
    return decided()
  tail = carry_tail(body, num_consts, num_carry) or ()
  return decided(None if tail else why, tail, why)


def groups_apart(program, graph) -> dict[tuple[int, ...], str]:
  """The groups of ``graph.loops`` (a ``RegionGraph`` of ``program``) whose
  one loop would hold nothing side by side, and why: every off-main body
  would run in place (``loop_body``), so all of them would run on the main
  stream one after the other. Such scans stay the loops ``jax.jit`` builds;
  a group keeps one loop where at least one body is a stream call."""
  apart = {}
  for group in graph.loops:
    hazards = {r: loop_body(program.jaxpr.eqns[graph.members[r][0]], r,
                            graph.streams[r]).in_place for r in group}
    if any(graph.streams[r] != 0 and why is None for r, why in hazards.items()):
      continue
    whys = {why: [r for r in group if hazards[r] == why]
            for why in hazards.values() if why is not None}
    reasons = (list(whys) if len(whys) == 1 else
               [f"{'+'.join(f'R{r}' for r in regions)}: {why}"
                for why, regions in whys.items()])
    apart[group] = ("every body would run in place, on the main stream one "
                    f"after the other ({'; '.join(reasons)})")
  return apart
