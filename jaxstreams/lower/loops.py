"""Emitting a group of independent scans as one loop, each body on its stream.

``partition.loops`` finds the groups (the same direction, each on a stream
of its own, none depending on another) and lays out scans of different
lengths; here a group becomes one ``lax.scan`` whose step runs every
member's body (several of its layers, where it is the longer): an off-main
member's as a stream call on its region's stream, the main stream's in
place. The loop runs where XLA compiles loops on every jaxlib (the main
thread of the program), and each step's bodies run side by side on their
streams.

A body that the installed XLA cannot compile as a stream call runs in
place, on the main stream, in the loop's step; where only its readings of
the carry after the next one is written stop it, those run after its call
there instead (``_Tail``). Which, and the group's phases, were decided
before emission (``lower/decide.py``, ``PartitionedProgram.decisions``):
here they are followed, not asked again. The loop's counter
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
import jax.numpy as jnp
import numpy as np

from jaxstreams import _compat
from jaxstreams.lower.calls import order_barrier, region_scope, stream_call
from jaxstreams.lower.packing import Packing
from jaxstreams.partition.loops import Phase
from jaxstreams.partition.partitioned import (BodyTail, LoopBody, LoopPlan,
                                              PartitionedProgram)


class _Member:
  """One scan of a group: its equation, region, stream and XLA stream, and
  its body as a function of (body constants, loop constants, carry,
  slices), run as ``decided`` (its ``LoopBody``, the functions cut
  before emission)."""

  def __init__(self, plan: PartitionedProgram, decided: LoopBody):
    region = decided.region
    (index,) = plan.graph.members[region]
    self.eqn = plan.program.jaxpr.eqns[index]
    self.region = region
    self.stream = plan.graph.streams[region]
    self.xla_stream = plan.decisions.xla_streams[region]
    self.body_consts = list(decided.body.consts)
    self.body = jcore.jaxpr_as_fun(decided.function)
    self.scan = jcore.jaxpr_as_fun(decided.scan)
    self.num_consts, self.num_carry = decided.num_consts, decided.num_carry
    self.unroll = int(self.eqn.params.get("unroll", 1))
    # Why its body cannot be a stream call here (then it runs in place, on
    # the main stream, inside the loop), or None; and the part of it that
    # runs after its call, on the main stream, so that the rest can be one.
    self.hazard = decided.in_place
    self.tail = _Tail(decided.split) if decided.split else None
    self.packed_as = decided.packed_as

  @property
  def on_stream(self) -> bool:
    return self.stream != 0 and self.hazard is None

  def split(self, values: Sequence[Any]):
    """The equation's operands as (loop constants, carry, slices)."""
    c, k = self.num_consts, self.num_carry
    return list(values[:c]), list(values[c:c + k]), list(values[c + k:])

  def step(self, layers: int, reverse: bool, called: bool = False
           ) -> Callable[..., list]:
    """A function of (constants, carry, slices) running ``layers`` of the
    scan's steps, in its direction, returning (carry, each layer's
    results): with one layer the slices are one step's and the results
    too; with several, each slice has a leading axis of ``layers`` (in
    layer order) and the results come layer by layer, in layer order
    (``_scan_phase`` writes them into the stacked results). Each layer is
    the scan's body, its operations unchanged.

    The layers' results are stacked outside this function, not in it:
    inside a stream call in a loop body, a stacking that reads the step's
    incoming carry and a result of the layer that writes the outgoing one
    makes XLA's loop-schedule linearizer (jaxlib 0.12) order the reading
    after the writing, a cycle its memory scheduler then aborts on
    (docs/xla.md).

    ``called``: what the body's stream call runs, where part of the body
    runs after it (``tail``): the rest of each layer, returning each
    layer's results as the tail's ``finish`` reads them."""
    body = self.tail.head if called and self.tail else self.body
    if layers == 1:
      return body
    consts = self.num_consts + len(self.body_consts)
    carried = self.num_carry

    def run(*values):
      fixed, carry = (list(values[:consts]),
                      list(values[consts:consts + carried]))
      slices = values[consts + carried:]
      made: list = [None] * layers
      for j in (reversed(range(layers)) if reverse else range(layers)):
        x = [jax.lax.index_in_dim(s, j, keepdims=False) for s in slices]
        out = list(body(*fixed, *carry, *x))
        carry, made[j] = out[:carried], out[carried:]
      return [*carry, *(y for layer in made for y in layer)]
    return run


class _Tail:
  """The equations of a body that run after its stream call, on the main
  stream (``limits.carry_tail``), as cut before emission (``BodyTail``):
  the call runs the rest (``head``), returning the carry, each layer's
  results that the rest makes and what the tail reads from it (incoming
  carry included); ``finish`` runs the tail for each layer and puts the
  results back in the body's order."""

  def __init__(self, cut: BodyTail):
    self.head = jcore.jaxpr_as_fun(cut.head)
    self.run_tail = jcore.jaxpr_as_fun(cut.tail)
    self.from_tail = cut.from_tail
    self.num_fixed, self.num_carry = cut.num_fixed, cut.num_carry
    self.num_head_ys, self.num_needed = cut.num_head_ys, cut.num_needed

  def finish(self, values: Sequence[Any], outs: Sequence[Any], layers: int
             ) -> list:
    """The body's results for ``layers`` layers from the call's ``outs``;
    ``values`` are the call's operands (constants, carry, slices)."""
    fixed = list(values[:self.num_fixed])
    slices = list(values[self.num_fixed + self.num_carry:])
    carry, made = list(outs[:self.num_carry]), list(outs[self.num_carry:])
    per_layer = self.num_head_ys + self.num_needed
    results = []
    for j in range(layers):
      mine = made[j * per_layer:(j + 1) * per_layer]
      x = slices if layers == 1 else [
          jax.lax.index_in_dim(v, j, keepdims=False) for v in slices]
      later = iter(self.run_tail(*fixed, *x, *mine[self.num_head_ys:]))
      kept = iter(mine[:self.num_head_ys])
      results += [next(later) if t else next(kept) for t in self.from_tail]
    return [*carry, *results]


def emit_group(plan: PartitionedProgram, group: LoopPlan,
               read: Callable[[Any], Any], *,
               out_of_graphs: bool = False) -> dict[Any, Any]:
  """Emit the scans of ``group`` as one loop, as decided before emission;
  returns each member's results by variable. ``read`` gives the value of a
  variable; each member's work is in its region's name scope.

  Scans of different lengths run as the group's phases (``group.phases``, from
  ``partition.loops.layout``): in each, one loop whose step runs every member's
  share of layers, its body called that many times over; a member alone in a
  phase runs its layers as a loop of its own, in place. Each step reads a
  member's layers from its whole stacked operands and writes their results into
  its whole stacked results (``_scan_phase``): nothing is cut out or put
  together around the loops.

  ``out_of_graphs``: keep each body's stream call out of XLA's CUDA graphs,
  where XLA's default graph builder would chain the bodies one after the
  other (jaxlib 0.10 and 0.11): the body ends in the runtime's zero-length
  ``delay``, a custom call XLA cannot capture, so XLA runs the call on its
  stream with events and launches its kernels one by one (the caller asks
  for it only where the runtime's CUDA library is there,
  ``Decisions.bodies_out_of_graphs``)."""
  members = [_Member(plan, body) for body in group.bodies]
  reads = [[v for v in m.eqn.invars if not isinstance(v, jcore.Literal)]
           for m in members]
  reverse, phases = group.reverse, group.phases
  # The XLA of jaxlib 0.10 and 0.11 does not schedule stream calls itself:
  # it may put a call's done right after its start, and then the bodies run
  # one after the other. One barrier over every body's operands and one over
  # every body's results (a main-stream body's too) make all the starts
  # come before any done, and the main-stream body run between them
  # (``pinned``). On 0.12 XLA's scheduler overlaps the calls itself, but
  # where the step's stacked outputs are updated by asynchronous copies it
  # hides those behind the main-stream body by putting an off-main body's
  # done before that body (the GRU bank's training step): the barrier over
  # the results alone keeps every update after every body. The one over
  # the operands makes XLA 0.12 exhaust memory compiling a training step
  # of scanned transformer towers (24 GB, deviceless), so 0.12 goes
  # without it (docs/xla.md).
  results_pinned = any(m.on_stream for m in members)
  pinned = results_pinned and not _compat.XLA_SCHEDULES_STREAM_CALLS

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
      with region_scope(m.region):
        results += m.scan(*flat[at:at + len(read_vars)])
      at += len(read_vars)
    return results

  def body_call(m: _Member, layers: int) -> tuple[Callable, "_Packed | None"]:
    """A function of (constants, carry, this step's slices) running
    ``layers`` of ``m``'s layers (in the scan's direction), returning
    (carry, the step's results): on its stream where it can be. Where
    XLA's scheduler runs a call with several results to its done before
    the next call starts (jaxlib 0.10), the call returns them in one
    buffer (the ``_Packed``, which unpacks them after the step's barrier
    over the calls' results: a single-result done waits for it)."""
    run = m.step(layers, reverse, called=m.on_stream)
    if not m.on_stream:
      return run, None
    if out_of_graphs:
      run = _outside_graphs(run)
    packed = (_Packed(run, m.packed_as)
              if pinned and m.packed_as is not None else None)
    return stream_call(packed or run, m.xla_stream, m.region), packed

  def one_loop(phase: Phase, consts, carry, xs, ys):
    """Run ``phase`` (members by position in it); returns (carry, stacked
    results) per member (``_scan_phase``: ``xs`` and ``ys``)."""
    group = [members[i] for i in phase.members]
    calls, packs = zip(*(body_call(m, k)
                         for m, k in zip(group, phase.per_step)))
    unrolls = {min(m.unroll, phase.steps) for m in group}
    unroll = (unrolls.pop() if len(unrolls) == 1
              and set(phase.per_step) == {1} else 1)

    def step(carry, sliced):
      inputs = [[*c, *h, *x] for c, h, x in zip(consts, carry, sliced)]
      if pinned:
        inputs = _together(inputs)
      outs = []
      for m, call, values in zip(group, calls, inputs):
        with region_scope(m.region):
          outs.append(list(call(*values)))
      if results_pinned:
        outs = [out if packed is None else packed.unpack(out)
                for packed, out in zip(packs, _together(outs))]
      for p, (m, k) in enumerate(zip(group, phase.per_step)):
        if m.on_stream and m.tail is not None:
          with region_scope(m.region):
            outs[p] = m.tail.finish(inputs[p], outs[p], k)
      return ([out[:m.num_carry] for m, out in zip(group, outs)],
              [out[m.num_carry:] for m, out in zip(group, outs)])

    return _scan_phase(step, phase, carry, xs, ys, reverse, unroll)

  def fused(*flat):
    consts, carry, xs = [], [], []
    for m, values in zip(members, operands(flat)):
      c, init, sliced = m.split(values)
      consts.append([*m.body_consts, *c])
      carry.append(init)
      xs.append(sliced)
    # Each member's stacked results, written layer by layer through the
    # phases (``_scan_phase``).
    ys = [[jnp.zeros(v.aval.shape, v.aval.dtype)
           for v in m.eqn.outvars[m.num_carry:]] for m in members]
    for phase in (reversed(phases) if reverse else phases):
      where = list(phase.members)
      if len(where) == 1:
        (i,) = where
        outs = [_alone(members[i], phase, consts[i], carry[i], xs[i], ys[i],
                       reverse)]
      else:
        outs = list(zip(*one_loop(phase, [consts[i] for i in where],
                                  [carry[i] for i in where],
                                  [xs[i] for i in where],
                                  [ys[i] for i in where])))
      for i, (c, y) in zip(where, outs):
        carry[i], ys[i] = c, y
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


def _alone(m: "_Member", phase: Phase, consts, carry, xs, ys,
           reverse: bool) -> tuple[list, list]:
  """A member's layers of ``phase`` (it alone) as a loop of its own, in
  place: the scan as written, over those layers."""
  run = m.step(1, reverse)

  def step(h, x):
    out = list(run(*consts, *h[0], *x[0]))
    return [out[:m.num_carry]], [out[m.num_carry:]]

  with region_scope(m.region):
    (carry,), (ys,) = _scan_phase(
        step, phase, [list(carry)], [xs], [ys], reverse,
        min(m.unroll, phase.steps))
  return carry, ys


def _scan_phase(step: Callable, phase: Phase, carry, xs, ys, reverse: bool,
                unroll: int) -> tuple[list, list]:
  """Run ``phase``'s loop of ``step(carry, slices) -> (carry, results)``
  (lists per member: each step's slices of its stacked operands ``xs``, and
  its layers' results, layer by layer in layer order); returns (carry,
  ``ys``) per member, ``ys`` being each member's whole stacked results, kept
  through the phases.

  Each step reads its layers from the whole operands and writes its
  results into the whole stacks, at its layers. Cutting a phase's layers
  out of an operand, or putting the phases' results together after, would
  copy them (XLA cannot alias part of a buffer; docs/xla.md, Memory, has
  what that cost towers of 10 and 4 layers). The step's layer comes from
  a counter the loop carries, not from slicing an index array: XLA then
  sees the offsets follow the loop's induction variable and copies the
  slices asynchronously, as for ``lax.scan``'s own (jaxlib 0.11 otherwise
  put each body's call done before the next call's start)."""
  def windowed(state, _):
    i, carry, ys = state
    at = [first + i * k for first, k in zip(phase.starts, phase.per_step)]
    sliced = [[_window(x, a, k) for x in member]
              for member, a, k in zip(xs, at, phase.per_step)]
    carry, made = step(carry, sliced)
    ys = [_put(wholes, member, a) for wholes, member, a in zip(ys, made, at)]
    return (i + (-1 if reverse else 1), carry, ys), None

  start = np.int32(phase.steps - 1 if reverse else 0)
  (_, carry, ys), _ = jax.lax.scan(
      windowed, (start, carry, ys), None, length=phase.steps,
      reverse=reverse, unroll=unroll)
  return carry, ys


def _window(x, first, layers: int):
  """Layers ``first`` to ``first + layers`` of a stacked operand (one
  layer: without the axis of layers)."""
  if layers == 1:
    return jax.lax.dynamic_index_in_dim(x, first, keepdims=False)
  return jax.lax.dynamic_slice_in_dim(x, first, layers)


def _put(wholes: list, made: list, first) -> list:
  """The stacked results ``wholes`` with ``made`` (each layer's results, in
  layer order) written at layers ``first`` on."""
  wholes = list(wholes)
  for j, y in enumerate(made):
    r, layer = j % len(wholes), j // len(wholes)
    wholes[r] = jax.lax.dynamic_update_index_in_dim(wholes[r], y,
                                                    first + layer, 0)
  return wholes


class _Packed:
  """A body that returns its results in one buffer of dtype ``carrier``
  (``Packing``, decided before emission: ``LoopBody.packed_as``) where
  they are several. ``unpack`` gives the results back."""

  def __init__(self, run: Callable[..., list], carrier):
    self.run = run
    self.carrier = carrier
    self.packing = None
    self.slots: list = []

  def __call__(self, *values):
    outs = list(self.run(*values))
    if len(outs) > 1:
      self.slots = [_Slot(jax.typeof(v)) for v in outs]
      self.packing = Packing(self.slots, self.carrier)
    return outs if self.packing is None else [self.packing.pack(outs)]

  def unpack(self, outs: list) -> list:
    if self.packing is None:
      return outs
    return [self.packing.unpack(outs[0], slot) for slot in self.slots]


class _Slot:
  """One result as ``Packing`` reads it: its aval."""

  def __init__(self, aval):
    self.aval = aval


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
