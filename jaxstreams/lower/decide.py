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
"""

from __future__ import annotations

import functools

from jaxstreams import _compat
from jaxstreams.lower.limits import (body_hazard, carry_hazard, carry_tail,
                                     regions_in_place, without_cse_barriers)
from jaxstreams.partition.loops import layout, loop_length
from jaxstreams.partition.partitioned import Decisions, LoopBody, LoopPlan
from jaxstreams.tag.read import primitives


def decide(program, graph) -> Decisions:
  """The decisions for ``program`` cut as ``graph`` (its ``RegionGraph``,
  its groups of loops final): every off-main region the installed XLA
  cannot compile as a stream call, and why, and how each group runs as
  one loop."""
  eqns = program.jaxpr.eqns
  holds = lambda i: primitives([eqns[k] for k in graph.members[i]])
  return Decisions(
      in_place=regions_in_place(graph.streams, holds, ()),
      loops=tuple(_loop_plan(program, graph, group) for group in graph.loops))


def _loop_plan(program, graph, regions) -> LoopPlan:
  eqns = [program.jaxpr.eqns[graph.members[r][0]] for r in regions]
  lengths = tuple(loop_length(eqn) for eqn in eqns)
  return LoopPlan(
      tuple(regions), bool(eqns[0].params["reverse"]), lengths,
      layout(lengths),
      tuple(loop_body(eqn, r, graph.streams[r])
            for eqn, r in zip(eqns, regions)))


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
