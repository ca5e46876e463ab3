"""Ordering: the order XLA:GPU sees a program's stream calls in.

Sequence points. The XLA of jaxlib 0.10 and 0.11 does not schedule a stream
call by itself (``_compat.XLA_SCHEDULES_STREAM_CALLS``): its memory scheduler
orders the program, moving each call-start as early and each call-done as
late as their operands and users allow, and it tends to run a region and
the main-stream work that reads it back to back, so nothing overlaps. For
the regions that can overlap other work (``overlappable_calls``), ``emit``
therefore writes the plan's order into the GPU program through a
``Sequencer`` (``order_barrier``; nothing on CPU):

* before the first main-stream equation after such calls, one barrier over
  the calls' inputs and every value still to be used: the call-starts come
  before all the work emitted after them;
* before a main-stream equation that reads such a call's results, one barrier
  over those results and every value still to be used: the call-done comes
  after all the work emitted before it; within a main-stream region, the
  equations that need no result in flight are emitted first;
* such a call returns its outputs packed in one buffer (``lower/packing.py``),
  unpacked after that barrier. A done lands right before its first user; a
  multi-output done's users are tuple elements, which the memory scheduler
  places wherever it likes, so only a single-output done can be pinned.

The ``jaxstreams_sequence_points`` option turns this off. It reads the
``PartitionedProgram`` (jaxpr variables and equations), never the user's
``StreamPlan`` report.

Collectives. A collective stays on the main stream (XLA:GPU compiles none
inside a stream call), and XLA:GPU's combiners merge independent collectives
of one kind into one, which waits for all their inputs: in a data-parallel
``shard_map`` step, every tower's gradient all-reduce becomes one, after the
last tower. Each collective that waits for stream calls therefore gets a
``combiner_key`` naming those calls (``combiner_keys``): XLA merges only
collectives that can start at the same point, and one tower's gradients
are reduced while another tower computes. For the XLA that schedules
stream calls itself, a call that a collective waits for returns its
outputs in one buffer (``packed_for_collectives`` says why). Both are
decided once per program, before emission (``lower/decide.py``); ``emit``
applies them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.extend.core as jcore

from jaxstreams import _compat, config
from jaxstreams.assign.cost import COLLECTIVES
from jaxstreams.lower.calls import order_barrier, stream_call
from jaxstreams.lower.packing import Packing
from jaxstreams.partition.partitioned import PartitionedProgram


def emitted(plan: PartitionedProgram, index: int) -> bool:
  """Whether ``emit`` emits region ``index`` where regions are calls: one
  that nothing reads and that has no effects is left out (jax would drop
  it when lowering)."""
  return bool(plan.graph.outputs[index]) or any(
      eqn.effects for eqn in plan.region_equations(index))


def calls_upstream(plan: PartitionedProgram):
  """The off-main regions (``calls``, one bit each in ``bit``) each region
  and each main-stream equation depends on, through any chain of values:
  ``(calls, bit, call_upstream, main_upstream)``, masks by region index and
  by equation index."""
  graph = plan.graph
  eqns = plan.program.jaxpr.eqns
  calls = [r for r, s in enumerate(graph.streams) if s != 0]
  bit = {r: 1 << k for k, r in enumerate(calls)}
  upstream: dict[Any, int] = {}
  call_upstream: dict[int, int] = {}
  main_upstream: dict[int, int] = {}

  def above(vars_):
    mask = 0
    for v in vars_:
      if not isinstance(v, jcore.Literal):
        mask |= upstream.get(v, 0)
    return mask

  for r, stream in enumerate(graph.streams):
    if stream != 0:
      call_upstream[r] = above(graph.inputs[r])
      for v in graph.outputs[r]:
        upstream[v] = call_upstream[r] | bit[r]
      continue
    for i in graph.members[r]:
      main_upstream[i] = above(eqns[i].invars)
      for v in eqns[i].outvars:
        upstream[v] = main_upstream[i]
  return calls, bit, call_upstream, main_upstream


def overlappable_calls(plan: PartitionedProgram) -> frozenset[int]:
  """The off-main regions that have work to overlap: a main-stream equation
  that does work and neither feeds nor reads them, or a region on another
  stream that neither depends on them nor they on it."""
  graph = plan.graph
  eqns = plan.program.jaxpr.eqns
  calls, bit, call_upstream, main_upstream = calls_upstream(plan)
  if not calls:
    return frozenset()
  # The calls that read each value, through any chain of values.
  downstream: dict[Any, int] = {}
  main_downstream: dict[int, int] = {}

  def below(vars_):
    mask = 0
    for v in vars_:
      mask |= downstream.get(v, 0)
    return mask

  for r in reversed(range(len(graph.streams))):
    if graph.streams[r] != 0:
      mask = below(graph.outputs[r]) | bit[r]
      for v in graph.inputs[r]:
        if not isinstance(v, jcore.Literal):
          downstream[v] = downstream.get(v, 0) | mask
      continue
    for i in reversed(graph.members[r]):
      main_downstream[i] = below(eqns[i].outvars)
      for v in eqns[i].invars:
        if not isinstance(v, jcore.Literal):
          downstream[v] = downstream.get(v, 0) | main_downstream[i]
  related = {i: main_upstream[i] | main_downstream[i] for i in main_upstream
             if plan.costs[i].flops or plan.costs[i].bytes}
  found = set()
  for r in calls:
    if any(not mask & bit[r] for mask in related.values()):
      found.add(r)
      continue
    for other in calls:
      if (graph.streams[other] != graph.streams[r]
          and not call_upstream[r] & bit[other]
          and not call_upstream[other] & bit[r]):
        found.add(r)
        break
  return frozenset(found)


class Sequencer:
  """Emits the sequence points (see the module docstring) while ``emit``
  walks the plan. It owns the environment from there on: the results of a
  packed call live in its buffer (``read`` unpacks one), and a call that
  reads them gets the buffer itself, unpacked inside its region, so no copy
  runs on the main stream."""

  @classmethod
  def for_plan(cls, plan: PartitionedProgram, env: dict,
               bind_equation: Callable[[int, list], Callable]
               ) -> "Sequencer | None":
    """The sequencer of ``plan``'s stream calls, or None where no sequence
    points are due. ``bind_equation(i, reads)``: a function of ``reads``'
    values binding main-stream equation ``i`` again (``emit``'s)."""
    if (_compat.XLA_SCHEDULES_STREAM_CALLS
        or not config.read("jaxstreams_sequence_points")):
      return None
    if _compat.BARRIER_JOINS_VARYING_AXES and len(
        {_compat.varying_axes(v.aval) for eqn in plan.program.jaxpr.eqns
         for v in eqn.outvars}) > 1:
      return None   # a barrier would make every value vary over every axis
    calls = overlappable_calls(plan)
    return cls(plan, env, calls, bind_equation) if calls else None

  def __init__(self, plan: PartitionedProgram, env: dict, calls: frozenset,
               bind_equation: Callable[[int, list], Callable]):
    self.plan = plan
    self.env = env
    self.calls = calls
    self.bind_equation = bind_equation
    graph = plan.graph
    self.packings = {r: Packing.of(graph.outputs[r]) for r in calls
                     if len(graph.outputs[r]) > 1}
    self.packed: dict[Any, Any] = {}    # output -> key of its call's buffer
    for r, packing in self.packings.items():
      if packing is not None:
        self.packed.update((v, ("buffer", r)) for v in graph.outputs[r])
    # Each main-stream region's equations in the order they are emitted:
    # those that need no result still in flight first.
    self.order = self._main_orders()
    # Steps: one per call, one per main-stream equation, in emission order.
    self.last_use: dict[Any, int] = {}
    # per step: what a fusible equation reads
    self.fused_reads: list[list] = []
    step = 0
    for index, stream in enumerate(graph.streams):
      if not emitted(plan, index):
        continue
      if stream != 0:
        self._use(graph.inputs[index], step)
        self.fused_reads.append(None)
        step += 1
        continue
      for i in self.order[index]:
        eqn = plan.program.jaxpr.eqns[i]
        self._use(eqn.invars, step)
        self.fused_reads.append(
            [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
            if plan.costs[i].kernels == 0 else None)
        step += 1
    self._use(plan.program.jaxpr.outvars, step)
    # Main-stream equations XLA fuses into their users (cost model: no
    # kernel of their own): their positions, by the values they make.
    eqns = plan.program.jaxpr.eqns
    self.fusible = {v: i for r, st in enumerate(graph.streams) if st == 0
                    for i in graph.members[r]
                    if plan.costs[i].kernels == 0 and not eqns[i].effects
                    for v in eqns[i].outvars}
    self.step = 0
    # inputs of pinned calls since the last barrier
    self.pending: list[Any] = []
    self.flying: set[Any] = set()   # results no main-stream equation read yet
    self.buffers: dict[Any, Any] = {}   # key -> the packed buffer, as of now

  def _main_orders(self) -> dict[int, list[int]]:
    """Per main-stream region, its equations with those that need no result
    of a pinned call still in flight moved ahead (in program order each):
    they run inside the calls' windows instead of after them. A region with
    side effects keeps its order."""
    graph, eqns = self.plan.graph, self.plan.program.jaxpr.eqns
    flying: set = set()
    orders = {}
    for index, stream in enumerate(graph.streams):
      if stream != 0:
        if index in self.calls:
          flying.update(graph.outputs[index])
        continue
      members = graph.members[index]
      if any(eqns[i].effects for i in members):
        orders[index] = list(members)
      else:
        waiting, needs = set(), []
        for i in members:
          if any(not isinstance(v, jcore.Literal)
                 and (v in flying or v in waiting)
                 for v in eqns[i].invars):
            waiting.update(eqns[i].outvars)
            needs.append(i)
        later = set(needs)
        orders[index] = [i for i in members if i not in later] + needs
      for i in orders[index]:
        flying.difference_update(v for v in eqns[i].invars
                                 if not isinstance(v, jcore.Literal))
    return orders

  def _use(self, vars_, step: int) -> None:
    for v in vars_:
      if isinstance(v, jcore.Literal):
        continue
      key = self.packed.get(v, v)
      self.last_use[key] = max(self.last_use.get(key, -1), step)

  def read(self, var):
    key = self.packed.get(var)
    if key is None:
      return self.env[var]
    return self.packings[key[1]].unpack(self.buffers[key], var)

  def call(self, fn, index: int) -> None:
    """Emit region ``index`` as a call. Packed inputs arrive as their buffers.
    A pinned call (one with work to overlap) waits for the next barrier and
    its results are in flight until a main-stream equation reads them."""
    graph = self.plan.graph
    outputs = graph.outputs[index]
    operands, where = [], {}
    sources = []     # per region input: (operand position, key or None)
    for var in graph.inputs[index]:
      key = self.packed.get(var)
      if key is None:
        sources.append((len(operands), None))
        operands.append(self.env[var])
      else:
        if key not in where:
          where[key] = len(operands)
          operands.append(self.buffers[key])
        sources.append((where[key], key))
    packing = self.packings.get(index)

    def body(*xs):
      inputs = [xs[p] if key is None else self.packings[key[1]].unpack(xs[p], v)
                for (p, key), v in zip(sources, graph.inputs[index])]
      results = fn(*inputs)
      return [packing.pack(results)] if packing is not None else results

    results = stream_call(body, self.plan.decisions.xla_streams[index],
                          index)(*operands)
    self.step += 1
    pinned = index in self.calls
    if pinned:
      self.pending.extend(x for x in operands if isinstance(x, jax.core.Tracer))
    if packing is not None:
      key = ("buffer", index)
      self.buffers[key] = results[0]
      self.flying.add(key)
      return
    for var, value in zip(outputs, results):
      self.env[var] = value
      if pinned:
        self.flying.add(var)

  def main_region(self, index: int):
    """A function binding a main-stream region's equations one by one into
    the environment, with sequence points where they are due. Given the
    region's inputs (a profiled region's are marked), it uses them."""
    graph = self.plan.graph

    def run(*inputs):
      for var, value in zip(graph.inputs[index], inputs):
        if var not in self.packed:
          self.env[var] = value
      for i in self.order[index]:
        eqn = self.plan.program.jaxpr.eqns[i]
        reads = list(dict.fromkeys(v for v in eqn.invars
                                   if not isinstance(v, jcore.Literal)))
        self._before(reads)
        results = self.bind_equation(i, reads)(
            *(self.read(v) for v in reads))
        for var, value in zip(eqn.outvars, results):
          self.env[var] = value
        self.step += 1
      return [self.read(v) for v in graph.outputs[index]]
    return run

  def _before(self, reads) -> None:
    if self.pending:
      self._barrier(self.pending)
      self.pending = []
    landing = [k for k in dict.fromkeys(self.packed.get(v, v) for v in reads)
               if k in self.flying]
    if landing:
      # Results read next by fusible work only (no kernel in between) land
      # with these: one barrier, not several that would split that work.
      for reads_next in self.fused_reads[self.step + 1:]:
        if reads_next is None:
          break
        landing += [k for k in dict.fromkeys(self.packed.get(v, v)
                                             for v in reads_next)
                    if k in self.flying and k not in landing]
      self.flying.difference_update(landing)
      self._barrier(landing)

  def _barrier(self, extra: list) -> None:
    """One barrier over every value still to be used and ``extra``: landing
    keys (their values, replaced by the barrier's) or plain values. A value
    made by elementwise work XLA fuses into its users is made again after the
    barrier from its inputs, which pass through instead: through a barrier
    it would be computed apart and stored."""
    held = {**self.env, **self.buffers}
    live = [k for k, value in held.items()
            if self.last_use.get(k, -1) >= self.step and k not in self.flying
            and isinstance(value, jax.core.Tracer)]
    eqns = self.plan.program.jaxpr.eqns
    remake, keys, seen = [], [], set()
    todo = [(k, False) for k in reversed(live)]
    while todo:   # depth first, inputs before the values made from them
      k, inputs_done = todo.pop()
      index = self.fusible.get(k)
      eqn = None if index is None else eqns[index]
      if inputs_done:
        remake.append(index)
        continue
      if k in seen:
        continue
      seen.add(k)
      inputs = [] if eqn is None else [self.packed.get(v, v) for v in eqn.invars
                                       if not isinstance(v, jcore.Literal)]
      if eqn is None or any(i in self.flying or i not in held for i in inputs):
        keys.append(k)   # through the barrier itself
        continue
      todo.append((k, True))
      todo.extend((i, False) for i in reversed(inputs))
    keys += [x for x in extra if _is_key(x)]
    values = [held[k] for k in keys] + [x for x in extra if not _is_key(x)]
    for key, value in zip(keys, order_barrier(values)):
      if key in self.buffers:
        self.buffers[key] = value
      else:
        self.env[key] = value
    for index in dict.fromkeys(remake):
      eqn = eqns[index]
      reads = list(dict.fromkeys(v for v in eqn.invars
                                 if not isinstance(v, jcore.Literal)))
      results = jcore.jaxpr_as_fun(self.plan.decisions.equations[index])(
          *(self.read(v) for v in reads))
      for var, value in zip(eqn.outvars, results):
        self.env[var] = value


def _is_key(x) -> bool:
  """Keys are jaxpr variables or ("buffer", region); values are arrays."""
  return isinstance(x, (jcore.Var, tuple))


# ---------------------------------------------------------------------------
# Collectives.

# The frontend attribute XLA:GPU's collective combiners add to their
# grouping key (jaxlib 0.10-0.12): collectives with different values are
# never combined into one.
COMBINER_KEY = "combiner_key"


def combiner_keys(waits: dict[int, tuple[int, ...]]) -> dict[int, str]:
  """A combiner key for each main-stream collective that waits for a stream
  call (``waits``: ``collective_waits``): the set of calls it waits for
  (``jaxstreams_after_R3_R5``).

  XLA:GPU's combiners merge independent collectives of one kind into one,
  and a merged collective waits for every input of them all. In a
  data-parallel step, each tower's gradients are all-reduced after its own
  backward region; merged, they are all-reduced after the last tower's
  region, and no all-reduce runs while a tower computes. Collectives keyed
  by the calls they wait for are merged only with those that can start at
  the same point anyway: one tower's gradients together, never two towers'.
  A collective that waits for no call is left to XLA (no key). Only
  collective primitives bound at this level are keyed (one inside a nested
  jit keeps what its own trace gave it)."""
  return {i: "jaxstreams_after_" + "_".join(f"R{r}" for r in waited)
          for i, waited in waits.items()}


def collective_waits(plan: PartitionedProgram) -> dict[int, tuple[int, ...]]:
  """The stream calls each main-stream collective waits for, where any."""
  calls, bit, _, main_upstream = calls_upstream(plan)
  eqns = plan.program.jaxpr.eqns
  return {i: tuple(r for r in calls if mask & bit[r])
          for i, mask in main_upstream.items()
          if mask and eqns[i].primitive.name in COLLECTIVES}


def packed_for_collectives(plan: PartitionedProgram,
                           waits: dict[int, tuple[int, ...]]
                           ) -> dict[int, Packing]:
  """Per stream call that a collective waits for and that has several
  outputs: their packing into one buffer. For the XLA that schedules stream
  calls itself (jaxlib 0.12) and no sequence points (which pack on their
  own). That XLA splits each element of a call's result tuple off as an
  async call of its own (a fragment: no kernel, a start and a done), and
  its latency-hiding scheduler counts the fragments' windows as time that
  hides a collective: it leaves the collectives after every region, none
  beside one (a data-parallel step, checked in deviceless H100 compiles).
  A call with one result has no fragment."""
  waited = {r for regions in waits.values() for r in regions}
  packings = {}
  for r in sorted(waited):
    outputs = plan.graph.outputs[r]
    if len(outputs) > 1:
      packing = Packing.of(outputs)
      if packing is not None:
        packings[r] = packing
  return packings
