"""Lowering: re-emit a planned program, one call per off-main region.

``emit`` runs inside the trace of the outer ``jax.jit``. It evaluates the
regions in plan order: a main-stream region's equations are bound inline,
exactly as ``jax.jit`` would bind them, and any other region becomes one
``call`` carrying ``_xla_stream_annotation="<stream>"`` and
``inlineable="false"``, which XLA:GPU runs on that compute stream with its
own events. XLA:CPU runs such a call as an ordinary computation.

It reads the ``PartitionedProgram`` (jaxpr variables and equations), never
the user's ``StreamPlan`` report.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.extend.core as jcore

from jaxstreams import _compat
from jaxstreams.partition.cut import part_function
from jaxstreams.partition.partitioned import PartitionedProgram


def region_function(plan: PartitionedProgram, index: int):
  """A function of the region's inputs returning its outputs."""
  graph = plan.graph
  return part_function(graph.inputs[index], graph.outputs[index],
                       plan.region_equations(index))


def emit(plan: PartitionedProgram, args: Sequence[Any], *, profile: bool = False
         ) -> list[Any]:
  """Evaluate ``plan``'s program on flat ``args`` (the traced function's
  flattened dynamic arguments), emitting the regions as planned. With
  ``profile``, each region is wrapped in timing markers."""
  program = plan.program
  graph = plan.graph
  if any(stream != 0 for stream in graph.streams):
    _compat.install_region_rules()
  env: dict[Any, Any] = {}
  for var, value in zip(program.jaxpr.constvars, program.consts):
    env[var] = value
  for var, value in zip(program.jaxpr.invars, args):
    env[var] = value

  for index, stream in enumerate(graph.streams):
    if not graph.outputs[index] and not _has_effects(plan, index):
      continue  # nothing reads it: jax.jit would drop it too
    fn = region_function(plan, index)
    if profile:
      from jaxstreams.runtime import profile as profiling
      region_id = profiling.new_region_id(f"{plan.function_name}/R{index}")
      fn = profiling.wrap_region(fn, region_id, stream)
    if stream != 0:
      fn = _compat.stream_call(fn, stream)
    results = fn(*(env[v] for v in graph.inputs[index]))
    for var, value in zip(graph.outputs[index], results):
      env[var] = value
  if profile:
    from jaxstreams.runtime import profile as profiling
    profiling.completion_token()

  return [v.val if isinstance(v, jcore.Literal) else env[v]
          for v in program.jaxpr.outvars]


def _has_effects(plan: PartitionedProgram, index: int) -> bool:
  return any(eqn.effects for eqn in plan.region_equations(index))
