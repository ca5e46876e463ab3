"""Lowering: re-emit a planned program, one call per off-main region.

``emit`` runs inside the trace of the outer ``jax.jit``. It evaluates the
regions in plan order: a main-stream region's equations are bound inline,
exactly as ``jax.jit`` would bind them, and any other region becomes one
``call`` carrying ``_xla_stream_annotation="<stream>"`` and
``inlineable="false"``, which XLA:GPU runs on that compute stream with its
own events. XLA:CPU runs such a call as an ordinary computation.

Sequence points. The XLA of jaxlib 0.10 and 0.11 does not schedule a stream
call by itself (``_compat.XLA_SCHEDULES_STREAM_CALLS``): its memory scheduler
orders the program, moving each call-start as early and each call-done as
late as their operands and users allow, and it tends to run a region and
the main-stream work that reads it back to back, so nothing overlaps. For
the regions that can overlap other work, ``emit`` therefore writes the plan's
order into the GPU program (``order_barrier``; nothing on CPU):

* before the first main-stream equation after such calls, one barrier over
  the calls' inputs and every value still to be used: the call-starts come
  before all the work emitted after them;
* before a main-stream equation that reads such a call's results, one barrier
  over those results and every value still to be used: the call-done comes
  after all the work emitted before it; within a main-stream region, the
  equations that need no result in flight are emitted first;
* such a call returns its outputs packed in one buffer, unpacked after that
  barrier. A done lands right before its first user; a multi-output done's
  users are tuple elements, which the memory scheduler places wherever it
  likes, so only a single-output done can be pinned.

The ``jaxstreams_sequence_points`` option turns this off. It reads the
``PartitionedProgram`` (jaxpr variables and equations), never the user's
``StreamPlan`` report.

A ``shard_map`` whose body has a plan of its own (``PartitionedProgram.
bodies``) is bound again through ``jax.shard_map`` with that plan emitted
as its body, so its regions are calls on every device. The ``bodies``
program does only that, leaving the top level's regions in place: a program
partitioned over several devices may get collectives from XLA's partitioner
inside any region, and XLA:GPU compiles no collective inside a stream call.

Collectives. A collective stays on the main stream (XLA:GPU compiles none
inside a stream call), and XLA:GPU's combiners merge independent collectives
of one kind into one, which waits for all their inputs: in a data-parallel
``shard_map`` step, every tower's gradient all-reduce becomes one, after the
last tower. ``emit`` therefore gives each collective that waits for stream
calls a ``combiner_key`` naming those calls (``combiner_keys``): XLA merges
only collectives that can start at the same point, and one tower's
gradients are reduced while another tower computes. For the XLA that
schedules stream calls itself, a call that a collective waits for returns
its outputs in one buffer (``_packed_for_collectives`` says why).

All of the above is for stream calls (the ``streams`` programs). The
``inline`` program binds every region's equations in place, in plan order:
the program ``jax.jit`` builds. Which program runs, with which compiler
options, is ``jaxstreams.lower.gpu``'s choice. Every region's equations are
emitted inside a name scope (``REGION_SCOPE``), so that XLA's kernels can be
traced back to their plan region in either program. Profiling always uses
stream calls: its timeline shows regions on streams.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata

from jaxstreams import _compat, config
from jaxstreams.assign.cost import COLLECTIVES
from jaxstreams.lower.limits import regions_in_place
from jaxstreams.lower.loops import emit_group
from jaxstreams.partition.cut import part_function
from jaxstreams.partition.partitioned import PartitionedProgram
from jaxstreams.tag.read import primitives

# The name scope around each region's equations. XLA keeps it in each
# instruction's op_name, so a kernel of a region emitted in place (no call
# of its own) is still traced back to its plan region (jaxstreams.xla_graphs).
REGION_SCOPE = "jaxstreams_region_{index}"

# The programs that run a group of independent loops as one loop with each
# body on its stream: stream calls, and jax.jit's program with loops fused
# ("loops_graphed": for CONCURRENT graphs, which draw a step's bodies apart
# in one graph; "loops": for XLA's default graphs, which before jaxlib 0.12
# chain a step's bodies, so they are kept out of graphs there).
FUSING_PROGRAMS = ("streams", "loops", "loops_graphed")


def emits_inline(plan: PartitionedProgram, program: str) -> bool:
  """Whether ``emit`` builds the ``inline`` program (the one ``jax.jit``
  builds) for ``plan`` when asked for ``program``: a program of stream
  calls with nothing off the main stream, or one that runs loops as one
  with no loops to group, binds every equation in place, in plan order, as
  ``inline`` does. Profiling aside, which makes calls in every program."""
  if program in ("streams", "bodies"):
    return not (plan.has_calls if program == "streams" else
                any(body.has_calls for body in plan.bodies.values()))
  if program in FUSING_PROGRAMS:
    return not plan.graph.loops
  return program == "inline"


def xla_stream(plan: PartitionedProgram, stream: int) -> int:
  """The XLA:GPU compute stream a region of plan stream ``stream`` runs on:
  the plan's off-main streams numbered from 1 in order. The plan's ids are
  the user's, and XLA numbers real streams: a program with stream id 10**6
  ran out of GPU memory on an H100 (jax 0.11.2)."""
  used = sorted({s for s in plan.graph.streams if s != 0})
  return used.index(stream) + 1


def region_function(plan: PartitionedProgram, index: int):
  """A function of the region's inputs returning its outputs."""
  graph = plan.graph
  return part_function(graph.inputs[index], graph.outputs[index],
                       plan.region_equations(index))


def emit(plan: PartitionedProgram, args: Sequence[Any], *, profile: bool = False,
         gpu_lowering: str = "inline", strict: bool = False) -> list[Any]:
  """Evaluate ``plan``'s program on flat ``args`` (the traced function's
  flattened dynamic arguments), emitting the regions as planned: in place
  (``gpu_lowering="inline"``), with independent loops run as one
  (``"loops"``) or as stream calls (``"streams"``, and always with
  ``profile``, which wraps each region in timing markers).

  A region that the installed XLA cannot compile as a stream call
  (``jaxstreams.lower.limits``) is emitted in place; with ``strict`` (a way
  the user asked for) lowering it for a GPU is a ``LoweringError``
  instead."""
  program = plan.program
  graph = plan.graph
  # Profiled, regions are calls too, except where calls cannot compile (the
  # "bodies" program of a partitioned program).
  stream_calls = (gpu_lowering == "streams"
                  or (profile and gpu_lowering != "bodies")) and any(
                      stream != 0 for stream in graph.streams)
  body_calls = (profile or gpu_lowering in ("streams", "bodies")) and any(
      body.has_calls for body in plan.bodies.values())
  if stream_calls or body_calls:
    _compat.install_region_rules()
  env: dict[Any, Any] = {}
  for var, value in zip(program.jaxpr.constvars, program.consts):
    env[var] = value
  for var, value in zip(program.jaxpr.invars, args):
    env[var] = value
  # Independent loops on different streams run as one loop, each body on
  # its stream (lower/loops.py), in every program but jax.jit's own.
  loop_groups = ({group[0]: group for group in graph.loops}
                 if gpu_lowering in FUSING_PROGRAMS else {})
  grouped = {r for group in loop_groups.values() for r in group}
  aside, refused = (_in_place(plan, grouped, gpu_lowering,
                              strict and gpu_lowering == "streams")
                    if stream_calls else ({}, {}))
  waits = _collective_waits(plan) if stream_calls else {}
  keys = combiner_keys(waits)
  order = (_Sequencer.for_plan(plan, env, keys)
           if stream_calls and not loop_groups and not aside and not refused
           else None)
  packings = (_packed_for_collectives(plan, waits) if stream_calls
              and order is None and _compat.XLA_SCHEDULES_STREAM_CALLS else {})

  for index, stream in enumerate(graph.streams):
    if index in loop_groups:
      env.update(emit_group(
          plan, loop_groups[index], env.__getitem__,
          lambda region: xla_stream(plan, graph.streams[region]),
          lambda region: jax.named_scope(REGION_SCOPE.format(index=region)),
          out_of_graphs=(gpu_lowering == "loops"
                         and not _compat.XLA_SCHEDULES_STREAM_CALLS)))
      continue
    if index in grouped:
      continue   # emitted with its group
    if stream_calls and not _emitted(plan, index):
      # Nothing reads it: jax drops it when lowering. In place it is
      # emitted all the same, so the traced program is the one jax.jit
      # traces (a tracer leaked into it fails the call, as under jax.jit).
      continue
    with jax.named_scope(REGION_SCOPE.format(index=index)):
      _emit_region(plan, index, env, order, profile,
                   stream_calls and index not in aside, body_calls, keys,
                   packings.get(index), refused.get(index))
  if profile:
    from jaxstreams.runtime import profile as profiling
    profiling.completion_token()

  return [v.val if isinstance(v, jcore.Literal)
          else (order.read(v) if order else env[v])
          for v in program.jaxpr.outvars]


def _in_place(plan: PartitionedProgram, grouped, way: str,
              strict: bool) -> tuple[dict[int, str], dict[int, str]]:
  """The off-main regions (not run as one loop) that the installed XLA
  cannot compile as stream calls: ``(in place, refused)``, each by region
  with why. By default such a region runs in place; with ``strict`` (a way
  asked for) it stays a call, marked so that lowering it for a GPU raises
  a ``LoweringError`` naming it (on CPU it runs in place like every
  region)."""
  streams = plan.graph.streams
  hazards = regions_in_place(
      streams, lambda i: primitives(plan.region_equations(i)), grouped)
  if not strict:
    return hazards, {}
  return {}, {index: (
      f"{plan.function_name}: gpu_lowering={way!r} cannot run region "
      f"R{index} (stream {streams[index]}) as a stream call: {why}. Leave "
      "gpu_lowering at its default (such a region then runs in place, "
      "independent loops side by side), or use 'loops' or 'inline'.")
      for index, why in hazards.items()}


def _emit_region(plan: PartitionedProgram, index: int, env: dict, order,
                 profile: bool, stream_calls: bool, body_calls: bool,
                 keys: dict[int, str], packing: "_Packing | None",
                 refused: str | None = None) -> None:
  """Emit region ``index`` into ``env`` (or through ``order``); a call with
  a ``packing`` returns its outputs in one buffer, unpacked after it; a
  call ``refused`` raises that when lowered for a GPU."""
  graph = plan.graph
  stream = graph.streams[index]
  if order is not None and stream == 0:
    fn = order.main_region(index)
  elif any((body_calls and i in plan.bodies) or i in keys
           for i in graph.members[index]):
    fn = _region_by_equation(plan, index, keys)
  else:
    fn = region_function(plan, index)
  if profile:
    from jaxstreams.runtime import profile as profiling
    region_id = profiling.new_region_id(f"{plan.function_name}/R{index}")
    fn = profiling.wrap_region(fn, region_id, stream)
  if order is not None and stream != 0:
    order.call(fn, index)
    return
  if order is not None and not profile:
    fn()   # binds the region's equations into the environment itself
    return
  inputs = [order.read(v) if order else env[v] for v in graph.inputs[index]]
  if stream != 0 and stream_calls:
    if packing is not None:
      unpacked = fn
      fn = lambda *xs: [packing.pack(unpacked(*xs))]
    fn = _compat.stream_call(fn, xla_stream(plan, stream), index, refused)
  results = fn(*inputs)
  if stream != 0 and stream_calls and packing is not None:
    results = [packing.unpack(results[0], v) for v in graph.outputs[index]]
  for var, value in zip(graph.outputs[index], results):
    env[var] = value


def _equation_function(plan: PartitionedProgram, i: int, reads,
                       keys: dict[int, str] | None = None):
  """A function of ``reads``' values binding equation ``i`` again: as it is
  (a collective with a combiner key in ``keys`` carrying it), or, for a
  ``shard_map`` with a planned body, through ``jax.shard_map`` with the
  body's regions emitted as stream calls (on every device)."""
  eqn = plan.program.jaxpr.eqns[i]
  body = plan.bodies.get(i)
  if body is None:
    bind = part_function(reads, eqn.outvars, [eqn])
    key = (keys or {}).get(i)
    if key is None:
      return bind

    def keyed(*values):
      with set_xla_metadata(**{COMBINER_KEY: key}):
        return bind(*values)
    return keyed

  def run(*values):
    env = dict(zip(reads, values))
    args = [v.val if isinstance(v, jcore.Literal) else env[v]
            for v in eqn.invars]
    return _compat.bind_shard_map(
        eqn, lambda *xs: emit(body, xs, gpu_lowering="streams"), args)
  return run


def _region_by_equation(plan: PartitionedProgram, index: int,
                        keys: dict[int, str]):
  """``region_function`` for a main-stream region holding a ``shard_map``
  with a planned body or a collective with a combiner key: its equations
  bound one by one (``_equation_function``)."""
  graph = plan.graph

  def run(*inputs):
    env = dict(zip(graph.inputs[index], inputs))
    for i in graph.members[index]:
      eqn = plan.program.jaxpr.eqns[i]
      reads = list(dict.fromkeys(v for v in eqn.invars
                                 if not isinstance(v, jcore.Literal)))
      results = _equation_function(plan, i, reads, keys)(
          *(env[v] for v in reads))
      env.update(zip(eqn.outvars, results))
    return [env[v] for v in graph.outputs[index]]
  return run


def _emitted(plan: PartitionedProgram, index: int) -> bool:
  return bool(plan.graph.outputs[index]) or any(
      eqn.effects for eqn in plan.region_equations(index))


def _calls_upstream(plan: PartitionedProgram):
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
  calls, bit, call_upstream, main_upstream = _calls_upstream(plan)
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


# The frontend attribute XLA:GPU's collective combiners add to their
# grouping key (jaxlib 0.10-0.12): collectives with different values are
# never combined into one.
COMBINER_KEY = "combiner_key"


def combiner_keys(waits: dict[int, tuple[int, ...]]) -> dict[int, str]:
  """A combiner key for each main-stream collective that waits for a stream
  call (``waits``: ``_collective_waits``): the set of calls it waits for
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


def _collective_waits(plan: PartitionedProgram) -> dict[int, tuple[int, ...]]:
  """The stream calls each main-stream collective waits for, where any."""
  calls, bit, _, main_upstream = _calls_upstream(plan)
  eqns = plan.program.jaxpr.eqns
  return {i: tuple(r for r in calls if mask & bit[r])
          for i, mask in main_upstream.items()
          if mask and eqns[i].primitive.name in COLLECTIVES}


def _packed_for_collectives(plan: PartitionedProgram,
                            waits: dict[int, tuple[int, ...]]
                            ) -> dict[int, "_Packing"]:
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
      packing = _Packing.of(outputs)
      if packing is not None:
        packings[r] = packing
  return packings


class _Sequencer:
  """Emits the sequence points (see the module docstring) while ``emit``
  walks the plan. It owns the environment from there on: the results of a
  packed call live in its buffer (``read`` unpacks one), and a call that
  reads them gets the buffer itself, unpacked inside its region, so no copy
  runs on the main stream."""

  @classmethod
  def for_plan(cls, plan: PartitionedProgram, env: dict,
               keys: dict[int, str]) -> "_Sequencer | None":
    if (_compat.XLA_SCHEDULES_STREAM_CALLS
        or not config.read("jaxstreams_sequence_points")):
      return None
    if _compat.BARRIER_JOINS_VARYING_AXES and len(
        {_compat.varying_axes(v.aval) for eqn in plan.program.jaxpr.eqns
         for v in eqn.outvars}) > 1:
      return None   # a barrier would make every value vary over every axis
    calls = overlappable_calls(plan)
    return cls(plan, env, calls, keys) if calls else None

  def __init__(self, plan: PartitionedProgram, env: dict, calls: frozenset,
               keys: dict[int, str]):
    self.plan = plan
    self.env = env
    self.calls = calls
    self.keys = keys
    graph = plan.graph
    self.packings = {r: _Packing.of(graph.outputs[r]) for r in calls
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
    self.fused_reads: list[list] = []   # per step: what a fusible equation reads
    step = 0
    for index, stream in enumerate(graph.streams):
      if not _emitted(plan, index):
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
    # kernel of their own), by the values they make.
    eqns = plan.program.jaxpr.eqns
    self.fusible = {v: eqns[i] for r, st in enumerate(graph.streams) if st == 0
                    for i in graph.members[r]
                    if plan.costs[i].kernels == 0 and not eqns[i].effects
                    for v in eqns[i].outvars}
    self.step = 0
    self.pending: list[Any] = []    # inputs of pinned calls since the last barrier
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
          if any(not isinstance(v, jcore.Literal) and (v in flying or v in waiting)
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
    stream, outputs = graph.streams[index], graph.outputs[index]
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

    results = _compat.stream_call(body, xla_stream(self.plan, stream),
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
        results = _equation_function(self.plan, i, reads, self.keys)(
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
    remake, keys, seen = [], [], set()
    todo = [(k, False) for k in reversed(live)]
    while todo:   # depth first, inputs before the values made from them
      k, inputs_done = todo.pop()
      eqn = self.fusible.get(k)
      if inputs_done:
        remake.append(eqn)
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
    for key, value in zip(keys, _compat.order_barrier(values)):
      if key in self.buffers:
        self.buffers[key] = value
      else:
        self.env[key] = value
    for eqn in dict.fromkeys(remake):
      reads = list(dict.fromkeys(v for v in eqn.invars
                                 if not isinstance(v, jcore.Literal)))
      results = part_function(reads, eqn.outvars, [eqn])(
          *(self.read(v) for v in reads))
      for var, value in zip(eqn.outvars, results):
        self.env[var] = value


def _is_key(x) -> bool:
  """Keys are jaxpr variables or ("buffer", region); values are arrays."""
  return isinstance(x, (jcore.Var, tuple))


class _Packing:
  """Several outputs in one 1-D buffer of one dtype and back, exactly. The
  floating outputs must share one dtype, which carries everything; booleans
  and integers that dtype holds exactly are converted, wider integers are
  bitcast (integers carry no gradient). Float packing is concatenation and
  slicing, so gradients flow through it; on CPU, where regions are inlined,
  XLA folds it away."""

  def __init__(self, outputs, carrier):
    self.carrier = np.dtype(carrier)
    self.slots = {}
    offset = 0
    for var in outputs:
      size = int(np.prod(var.aval.shape, dtype=np.int64)) * self._width(var.aval.dtype)
      self.slots[var] = (offset, size)
      offset += size

  @classmethod
  def of(cls, outputs) -> "_Packing | None":
    if len({_compat.varying_axes(v.aval) for v in outputs}) > 1:
      # In a shard_map body, values that vary over different mesh axes: one
      # buffer would vary over them all, and no slice of it could be the
      # same on every device again.
      return None
    dtypes = [np.dtype(v.aval.dtype) for v in outputs]
    floats = {d for d in dtypes if jnp.issubdtype(d, jnp.floating)}
    if len(floats) > 1 or any(jnp.issubdtype(d, jnp.complexfloating)
                              for d in dtypes):
      return None
    carrier = floats.pop() if floats else np.dtype(np.uint8)
    for d in dtypes:
      if d != carrier and cls._how(d, carrier) is None:
        return None
    return cls(outputs, carrier)

  @staticmethod
  def _how(dtype, carrier) -> str | None:
    if dtype == np.bool_:
      return "convert"
    if not jnp.issubdtype(dtype, jnp.integer):
      return None
    if dtype.itemsize % carrier.itemsize == 0:
      return "bitcast"
    if (jnp.issubdtype(carrier, jnp.floating)
        and np.iinfo(dtype).bits <= jnp.finfo(carrier).nmant + 1):
      return "convert"
    return None

  def _width(self, dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype != self.carrier and self._how(dtype, self.carrier) == "bitcast":
      return dtype.itemsize // self.carrier.itemsize
    return 1

  def pack(self, values):
    parts = []
    for value in values:
      dtype = np.dtype(value.dtype)
      if dtype != self.carrier:
        if self._how(dtype, self.carrier) == "bitcast":
          value = jax.lax.bitcast_convert_type(value, self.carrier)
        else:
          value = value.astype(self.carrier)
      parts.append(value.reshape(-1))
    return jnp.concatenate(parts)

  def unpack(self, buffer, var):
    offset, size = self.slots[var]
    piece = buffer[offset:offset + size]
    aval = var.aval
    dtype = np.dtype(aval.dtype)
    if dtype == self.carrier:
      return piece.reshape(aval.shape)
    if self._how(dtype, self.carrier) == "bitcast":
      width = self._width(dtype)
      piece = piece.reshape(*aval.shape, width) if width > 1 else piece.reshape(aval.shape)
      value = jax.lax.bitcast_convert_type(piece, dtype)
    else:
      value = piece.reshape(aval.shape).astype(dtype)
    # Materialized before use: XLA 0.10 fails to compile some fusions of this
    # conversion into a dot ("Couldn't find output tile sizes").
    return _compat.order_barrier([value])[0]
