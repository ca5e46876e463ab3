"""Lowering: re-emit a planned program, one call per off-main region.

``emit`` runs inside the trace of the outer ``jax.jit``. It evaluates the
regions in plan order: a main-stream region's equations are bound inline,
exactly as ``jax.jit`` would bind them, and any other region becomes one
stream call (``lower/calls.py``): a ``call`` carrying
``_xla_stream_annotation="<stream>"`` and ``inlineable="false"``, which
XLA:GPU runs on that compute stream with its own events. XLA:CPU runs such
a call as an ordinary computation. A region that the installed XLA cannot
compile as a call is emitted in place: which ones, like how each group of
loops runs as one, was decided before emission (``lower/decide.py``, kept
in ``PartitionedProgram.decisions``); emission follows those decisions.

Around the calls, ``lower/order.py`` decides the order XLA sees: sequence
points for the XLA that does not schedule stream calls itself, and combiner
keys that keep XLA from merging collectives that wait for different calls.
Independent loops on different streams run as one loop, each body on its
stream (``lower/loops.py``).

A ``shard_map`` whose body has a plan of its own (``PartitionedProgram.
bodies``) is bound again through ``jax.shard_map`` with that plan emitted
as its body, so its regions are calls on every device. The ``bodies``
program does only that, leaving the top level's regions in place: a program
partitioned over several devices may get collectives from XLA's partitioner
inside any region, and XLA:GPU compiles no collective inside a stream call.

All of the above is for stream calls (the ``streams`` programs). The
``inline`` program binds every region's equations in place, in plan order:
the program ``jax.jit`` builds. Which program runs, with which compiler
options, is ``jaxstreams.lower.gpu``'s choice. Every region's equations are
emitted inside a name scope (``calls.REGION_SCOPE``), so that XLA's kernels
can be traced back to their plan region in either program. Profiling always uses
stream calls: its timeline shows regions on streams.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.extend.core as jcore
from jax.experimental.xla_metadata import set_xla_metadata

from jaxstreams import _compat
from jaxstreams.lower.calls import (install_region_rules, region_scope,
                                    stream_call)
from jaxstreams.lower.loops import emit_group
from jaxstreams.lower.order import COMBINER_KEY, Sequencer
from jaxstreams.lower.packing import Packing
from jaxstreams.partition.partitioned import PartitionedProgram

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


def region_function(plan: PartitionedProgram, index: int):
  """A function of the region's inputs returning its outputs (the region
  as cut before emission, ``Decisions.regions``)."""
  return jcore.jaxpr_as_fun(plan.decisions.regions[index])


def emit(plan: PartitionedProgram, args: Sequence[Any], *,
         profile: bool = False, gpu_lowering: str = "inline",
         strict: bool = False) -> list[Any]:
  """Evaluate ``plan``'s program on flat ``args`` (the traced function's
  flattened dynamic arguments), emitting the regions as planned: in place
  (``gpu_lowering="inline"``), with independent loops run as one
  (``"loops"``) or as stream calls (``"streams"``, and always with
  ``profile``, which wraps each region in timing markers).

  A region that the installed XLA cannot compile as a stream call
  (``jaxstreams.lower.limits``) is emitted in place; with ``strict`` (a way
  the user asked for) lowering it for a GPU is a ``LoweringError``
  instead.

  Where planning took a ``jax.checkpoint`` or a custom_jvp / custom_vjp
  function apart (``ExposedProgram.differentiate_as``), the emitted
  program is a ``jax.custom_jvp`` function whose derivative is the traced
  program's: differentiated from outside (``jax.grad`` of a function that
  calls this one), it recomputes what the checkpoint's policy says and
  runs the user's derivative rules, as under ``jax.jit``."""
  traced = plan.program.differentiate_as
  if traced is None:
    return _emit(plan, args, profile, gpu_lowering, strict)

  @jax.custom_jvp
  def run(*values):
    return _arrays(_emit(plan, values, profile, gpu_lowering, strict))

  @run.defjvp
  def derivative(primals, tangents):
    outs, out_tangents = jax.jvp(jcore.jaxpr_as_fun(traced), primals,
                                 tangents)
    return _arrays(outs), list(out_tangents)

  return run(*args)


def _arrays(values) -> list[Any]:
  """A custom_jvp function's results: arrays (a result that is a literal
  of the program comes as its Python or NumPy value)."""
  return [v if isinstance(v, jax.Array) or isinstance(v, jax.core.Tracer)
          else jax.numpy.asarray(v) for v in values]


def _emit(plan: PartitionedProgram, args: Sequence[Any], profile: bool,
          gpu_lowering: str, strict: bool) -> list[Any]:
  program = plan.program
  graph = plan.graph
  # Profiled, regions are calls too, except where calls cannot compile (the
  # "bodies" program of a partitioned program).
  stream_calls = (gpu_lowering == "streams"
                  or (profile and gpu_lowering != "bodies")) and any(
                      stream != 0 for stream in graph.streams)
  body_calls = (profile or gpu_lowering in ("streams", "bodies")) and any(
      body.has_calls for body in plan.bodies.values())
  # Independent loops on different streams run as one loop, each body on
  # its stream (lower/loops.py), in every program but jax.jit's own.
  loop_groups = ({group.regions[0]: group for group in plan.decisions.loops}
                 if gpu_lowering in FUSING_PROGRAMS else {})
  if stream_calls or body_calls or loop_groups:
    install_region_rules()
  env: dict[Any, Any] = {}
  for var, value in zip(program.jaxpr.constvars, program.consts):
    env[var] = value
  for var, value in zip(program.jaxpr.invars, args):
    env[var] = value
  grouped = {r for group in loop_groups.values() for r in group.regions}
  aside, refused = (_in_place(plan, grouped, gpu_lowering,
                              strict and gpu_lowering == "streams")
                    if stream_calls else ({}, {}))
  keys = plan.decisions.combiner_keys if stream_calls else {}
  sequenced = stream_calls and not loop_groups and not aside and not refused
  order = (Sequencer.for_plan(plan, env, lambda i, reads: _equation_function(
      plan, i, reads, keys)) if sequenced else None)
  # Only the XLA that schedules stream calls itself packs for collectives
  # (Decisions.collective_packings), and it has no sequence points.
  packings = plan.decisions.collective_packings if stream_calls else {}

  for index, stream in enumerate(graph.streams):
    if index in loop_groups:
      env.update(emit_group(
          plan, loop_groups[index], env.__getitem__,
          out_of_graphs=(gpu_lowering == "loops"
                         and not _compat.XLA_SCHEDULES_STREAM_CALLS
                         and plan.decisions.bodies_out_of_graphs)))
      continue
    if index in grouped:
      continue   # emitted with its group
    if stream_calls and index in plan.decisions.unread:
      # Nothing reads it: jax drops it when lowering. In place it is
      # emitted all the same, so the traced program is the one jax.jit
      # traces (a tracer leaked into it fails the call, as under jax.jit).
      continue
    with region_scope(index):
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
  cannot compile as stream calls (``plan.decisions.in_place``): ``(in
  place, refused)``, each by region with why. By default such a region
  runs in place; with ``strict`` (a way asked for) it stays a call, marked
  so that lowering it for a GPU raises a ``LoweringError`` naming it (on
  CPU it runs in place like every region)."""
  streams = plan.graph.streams
  hazards = {index: why for index, why in plan.decisions.in_place.items()
             if index not in grouped}
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
                 keys: dict[int, str], packing: Packing | None,
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
    fn = stream_call(fn, plan.decisions.xla_streams[index], index, refused)
  results = fn(*inputs)
  if stream != 0 and stream_calls and packing is not None:
    results = [packing.unpack(results[0], v) for v in graph.outputs[index]]
  for var, value in zip(graph.outputs[index], results):
    env[var] = value


def _equation_function(plan: PartitionedProgram, i: int, reads,
                       keys: dict[int, str] | None = None):
  """A function of ``reads``' values (what the equation reads, each once,
  first read first) binding main-stream equation ``i`` again: as it is
  (``Decisions.equations``; a collective with a combiner key in ``keys``
  carrying it), or, for a ``shard_map`` with a planned body, through
  ``jax.shard_map`` with the body's regions emitted as stream calls (on
  every device)."""
  eqn = plan.program.jaxpr.eqns[i]
  body = plan.bodies.get(i)
  if body is None:
    bind = jcore.jaxpr_as_fun(plan.decisions.equations[i])
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
