"""Calls with frontend attributes, as jax makes and lowers them (a room of
``jaxstreams._compat``, which re-exports its names).

jax's ``xla_metadata_call`` carries jaxstreams' region calls
(``jaxstreams.lower.calls``); jax's own lowering rule for it, and its
partial evaluation, are reached here.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import jax
from jax.extend import source_info_util


def _find_xla_metadata_call() -> Callable[..., Any]:
  for module_name in ("jax.experimental.xla_metadata",
                      "jax.experimental.scheduling_groups"):
    try:
      module = importlib.import_module(module_name)
    except ImportError:
      continue
    fn = getattr(module, "xla_metadata_call", None)
    if fn is not None:
      return fn
  raise ImportError(
      "jaxstreams needs jax's xla_metadata_call "
      "(jax.experimental.xla_metadata or jax.experimental.scheduling_groups); "
      f"jax {jax.__version__} has neither. Install jax>=0.10.")


# ``xla_metadata_call(fn, **attributes)``: ``fn`` as one call op with these
# frontend attributes, a primitive with the full set of jvp / linearize /
# transpose / batching / DCE rules.
xla_metadata_call = _find_xla_metadata_call()


def call_metadata(params: dict) -> dict[str, str]:
  """The frontend attributes of an xla_metadata_call equation: jax 0.10 keeps
  them as keyword params, later versions as an ``xla_metadata`` tuple."""
  if "xla_metadata" in params:
    return dict(params["xla_metadata"])
  return {k: v for k, v in params.items() if isinstance(v, str)}


def default_lowering(primitive) -> Callable:
  """jax's own lowering rule of ``primitive`` (for every platform), for a
  rule registered for one platform to fall back on. Internal to jax."""
  from jax._src.interpreters import mlir as mlir_internal
  entry = mlir_internal._lowerings[primitive]
  return getattr(entry, "rule", entry)   # a LoweringRuleEntry since 0.9


def split_calls_by_known_inputs(primitive, applies: Callable[[dict], bool]
                                ) -> None:
  """Give the call primitive ``primitive`` (its equations carry a
  ``jaxpr``) a partial-evaluation rule for the equations whose parameters
  ``applies`` to: a call with known and unknown inputs is split by data
  dependence into a call of the known work and a call of the unknown work,
  each with the equation's parameters, as jax does for its own call
  primitives. Other equations keep jax's default; nothing changes where
  this jax has a rule of its own. Internal to jax (``partial_eval``)."""
  from jax._src.interpreters import partial_eval as pe
  if primitive in pe.custom_partial_eval_rules:
    return   # a jax with its own rule

  def partial_eval(trace, *tracers, jaxpr, **params):
    if not applies(params):
      return trace.default_process_primitive(
          primitive, tracers, dict(params, jaxpr=jaxpr))
    unknown_in = [not t.pval.is_known() for t in tracers]
    known_jaxpr, unknown_jaxpr, unknown_out, residual_avals = \
        pe.partial_eval_jaxpr_nounits(jaxpr, unknown_in, instantiate=False)
    known_in = [t.pval.get_known() for t in tracers if t.pval.is_known()]
    known_results = primitive.bind(*known_in, jaxpr=known_jaxpr, **params)
    split = len(known_results) - len(residual_avals)
    known_out, residuals = known_results[:split], known_results[split:]
    unknown_tracers_in = [*map(trace.new_instantiated_const, residuals),
                          *(t for t in tracers if not t.pval.is_known())]
    unknown_tracers_out = [pe.JaxprTracer(trace, pe.PartialVal.unknown(aval),
                                          None)
                           for aval in unknown_jaxpr.out_avals]
    recipe = pe.new_eqn_recipe(trace, unknown_tracers_in, unknown_tracers_out,
                               primitive, dict(params, jaxpr=unknown_jaxpr),
                               unknown_jaxpr.effects,
                               source_info_util.current())
    for tracer in unknown_tracers_out:
      tracer.recipe = recipe
    known_iter, unknown_iter = iter(known_out), iter(unknown_tracers_out)
    return [next(unknown_iter) if u else next(known_iter) for u in unknown_out]

  pe.custom_partial_eval_rules[primitive] = partial_eval


def results_through_one_tuple(ctx, results: list) -> list:
  """Make the call op that lowered to ``results`` (jax's ``func.call`` of a
  region, with its frontend attributes) return them as one tuple, taken
  apart by ``get_tuple_element`` ops of their own; returns the new values.

  XLA's translation of a call with several results gives each of the
  ``get-tuple-element`` instructions it makes for them the call's frontend
  attributes, and from jaxlib 0.11 XLA:GPU runs every instruction that
  carries ``_xla_stream_annotation`` as a stream call of its own (its
  ``ExplicitStreamAnnotationAsyncWrapper`` wraps what is not a call into
  one): a region of k results became 1 + k calls, each with its events.
  Separate ops carry no attributes, so the region stays one call. Internal
  to jax (its MLIR bindings and module context)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import func as func_dialect
  from jax._src.lib.mlir.dialects import hlo
  if len(results) < 2:
    return results
  call = results[0].owner
  if (not isinstance(call, func_dialect.CallOp)
      or list(call.results) != list(results)):
    return results
  types = [r.type for r in results]
  tupled = ir.TupleType.get_tuple(types)
  operands = list(call.operands)
  with ir.InsertionPoint(ctx.module_context.module.body), call.location:
    wrapper = func_dialect.FuncOp(
        call.attributes["callee"].value + "_tupled",
        ([v.type for v in operands], [tupled]))
  wrapper.attributes["sym_visibility"] = ir.StringAttr.get("private")
  ctx.module_context.symbol_table.insert(wrapper)
  block = wrapper.add_entry_block()
  with ir.InsertionPoint(block), call.location:
    inner = func_dialect.CallOp(types, call.attributes["callee"],
                                list(block.arguments))
    func_dialect.ReturnOp([hlo.tuple(list(inner.results))])
  with ir.InsertionPoint(call), call.location:
    outer = func_dialect.CallOp(
        [tupled], ir.FlatSymbolRefAttr.get(wrapper.name.value), operands)
    if "mhlo.frontend_attributes" in call.attributes:
      outer.attributes["mhlo.frontend_attributes"] = (
          call.attributes["mhlo.frontend_attributes"])
    values = [hlo.get_tuple_element(outer.result, i)
              for i in range(len(types))]
  call.erase()
  return values
