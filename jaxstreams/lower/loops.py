"""Emitting a group of independent scans as one loop, each body on its stream.

``partition.loops`` finds the groups (the same length and direction, each on
a stream of its own, none depending on another); here a group becomes one
``lax.scan`` whose step runs every member's body: an off-main member's as a
stream call on its region's stream, the main stream's in place. The loop
runs where XLA compiles loops on every jaxlib (the main thread of the
program), and each step's bodies run side by side on their streams.

A body that the installed XLA cannot compile as a stream call (``limits``)
runs in place, on the main stream, in the loop's step. The loop's counter
and the bodies' constants stay outside the calls (jaxlib 0.12 crashes on a
constant inside one; ``calls`` lowers region calls so).

On CPU the members run as the loops ``jax.jit`` builds (``lax.
platform_dependent``): XLA:CPU has one stream, and its programs stay
bitwise those of ``jax.jit``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jcore
import numpy as np

from jaxstreams import _compat
from jaxstreams.lower.calls import (install_region_rules, order_barrier,
                                    stream_call)
from jaxstreams.lower.limits import body_hazard, without_cse_barriers
from jaxstreams.partition.cut import part_function
from jaxstreams.partition.partitioned import PartitionedProgram


class _Member:
  """One scan of a group: its equation, region and stream, and its body as
  a function of (body constants, loop constants, carry, slices)."""

  def __init__(self, plan: PartitionedProgram, region: int):
    (index,) = plan.graph.members[region]
    self.eqn = plan.program.jaxpr.eqns[index]
    self.region = region
    self.stream = plan.graph.streams[region]
    params = self.eqn.params
    body = _compat.nested_jaxpr({"jaxpr": params["jaxpr"]})
    inner = body.jaxpr
    self.body_consts = list(body.consts)
    eqns = without_cse_barriers(inner.eqns)
    self.body = part_function([*inner.constvars, *inner.invars],
                              inner.outvars, eqns)
    self.num_consts, self.num_carry = _compat.scan_counts(params)
    # Why its body cannot be a stream call here (then it runs in place, on
    # the main stream, inside the loop), or None.
    self.hazard = body_hazard(inner.eqns) if self.stream != 0 else None

  @property
  def on_stream(self) -> bool:
    return self.stream != 0 and self.hazard is None

  def split(self, values: Sequence[Any]):
    """The equation's operands as (loop constants, carry, slices)."""
    c, k = self.num_consts, self.num_carry
    return list(values[:c]), list(values[c:c + k]), list(values[c + k:])


def emit_group(plan: PartitionedProgram, regions: Sequence[int],
               read: Callable[[Any], Any], stream_of: Callable[[int], int],
               scope: Callable[[int], Any], *,
               out_of_graphs: bool = False) -> dict[Any, Any]:
  """Emit the scans of ``regions`` (one group) as one loop; returns each
  member's results by variable. ``read`` gives the value of a variable,
  ``stream_of(region)`` the XLA stream of an off-main member's calls, and
  ``scope(region)`` the name scope of a member's work.

  ``out_of_graphs``: keep each body's stream call out of XLA's CUDA graphs,
  where XLA's default graph builder would chain the bodies one after the
  other (jaxlib 0.10 and 0.11): the body ends in the runtime's zero-length
  ``delay``, a custom call XLA cannot capture, so XLA runs the call on its
  stream with events and launches its kernels one by one. Where the
  runtime's CUDA library is not there, the bodies stay in the graph."""
  members = [_Member(plan, r) for r in regions]
  reads = [[v for v in m.eqn.invars if not isinstance(v, jcore.Literal)]
           for m in members]
  params = members[0].eqn.params
  length, reverse = int(params["length"]), bool(params["reverse"])
  unrolls = {m.eqn.params.get("unroll", 1) for m in members}
  unroll = unrolls.pop() if len(unrolls) == 1 else 1
  install_region_rules()
  # The XLA of jaxlib 0.10 and 0.11 does not schedule stream calls itself:
  # it may put a call's done right after its start, and then the bodies run
  # one after the other. One barrier over every body's operands and one over
  # every body's results (a main-stream body's too) make all the starts
  # come before any done, and the main-stream body run between them. Not on
  # 0.12: there the same barriers make XLA exhaust memory compiling a
  # training step of scanned transformer towers (24 GB, deviceless), and
  # its own scheduler overlaps the bodies, except where the stacked
  # outputs' updates wait on a body (docs/xla.md).
  pinned = (not _compat.XLA_SCHEDULES_STREAM_CALLS
            and any(m.on_stream for m in members))
  if out_of_graphs:
    from jaxstreams.runtime import _loader
    out_of_graphs = {"cpu", "cuda"} <= set(_loader.available_platforms())

  def operands(flat):
    """Per member, its values in operand order (literals filled in)."""
    values, at = [], 0
    for m, read_vars in zip(members, reads):
      given = dict(zip(read_vars, flat[at:at + len(read_vars)]))
      at += len(read_vars)
      values.append([np.asarray(v.val, v.aval.dtype)
                     if isinstance(v, jcore.Literal) else given[v]
                     for v in m.eqn.invars])
    return values

  def separate(*flat):
    """The members as the scans they were (what XLA:CPU runs)."""
    results, at = [], 0
    for m, read_vars in zip(members, reads):
      bind = part_function(read_vars, m.eqn.outvars, [m.eqn])
      with scope(m.region):
        results += bind(*flat[at:at + len(read_vars)])
      at += len(read_vars)
    return results

  def fused(*flat):
    loop_consts, inits, xs = [], [], []
    for m, values in zip(members, operands(flat)):
      consts, init, sliced = m.split(values)
      loop_consts.append([*m.body_consts, *consts])
      inits.append(init)
      xs.append(sliced)

    def step(carry, sliced):
      operands = [[*consts, *c, *x]
                  for consts, c, x in zip(loop_consts, carry, sliced)]
      if pinned:
        operands = _together(operands)
      outs = []
      for m, values in zip(members, operands):
        body = m.body
        if m.on_stream:
          if out_of_graphs:
            body = _outside_graphs(body)
          body = stream_call(body, stream_of(m.region), m.region)
        with scope(m.region):
          outs.append(list(body(*values)))
      if pinned:
        outs = _together(outs)
      return ([out[:m.num_carry] for m, out in zip(members, outs)],
              [out[m.num_carry:] for m, out in zip(members, outs)])

    carry, ys = jax.lax.scan(step, inits, xs, length=length, reverse=reverse,
                             unroll=unroll)
    return [v for c, y in zip(carry, ys) for v in (*c, *y)]

  flat = [read(v) for read_vars in reads for v in read_vars]
  results = jax.lax.platform_dependent(*flat, cpu=separate, default=fused)
  found: dict[Any, Any] = {}
  at = 0
  for m in members:
    for var in m.eqn.outvars:
      found[var] = results[at]
      at += 1
  return found


def _together(groups: Sequence[Sequence[Any]]) -> list[list[Any]]:
  """``groups`` of values through one optimization barrier (GPU only):
  every value is ready before any is read."""
  flat = [v for group in groups for v in group]
  if not flat:
    return [list(g) for g in groups]
  passed = iter(order_barrier(flat))
  return [[next(passed) for _ in group] for group in groups]


def _outside_graphs(body: Callable[..., list]) -> Callable[..., list]:
  """``body`` ending in a custom call XLA cannot put into a CUDA graph (the
  runtime's ``delay`` of zero microseconds, through which its smallest
  result passes unchanged)."""
  from jaxstreams.runtime import delay

  def run(*args):
    outs = list(body(*args))
    if outs:
      k = min(range(len(outs)), key=lambda i: np.size(outs[i]))
      outs[k] = delay(outs[k], microseconds=0)
    return outs
  return run
