"""Region calls: a region as one call that XLA:GPU runs on a stream, and the
rules jax lowers such calls by.

* ``stream_call``: wraps a function so that it lowers to one ``call`` op with
  the frontend attributes ``_xla_stream_annotation`` and ``inlineable``.
  JAX exposes this as ``xla_metadata_call`` (``_compat`` finds it), a
  primitive with the full set of jvp / linearize / transpose / batching /
  DCE rules, so regions stay regions under ``jax.grad`` and ``jax.vmap``
  applied outside. ``order_barrier`` is the same primitive around
  ``optimization_barrier``.
* ``install_region_rules``: what such calls need from jax for
  ``jaxstreams.jit`` to be a drop-in for ``jax.jit`` (inline on CPU, calls
  XLA:GPU compiles, a partial-evaluation rule for ``jax.checkpoint``).
  Installed by the first emission of a region, not at import: importing
  jaxstreams changes nothing in jax. Calls that are not jaxstreams' keep
  jax's own rules. The jax internals they need come from ``_compat``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jcore
import jax.interpreters.mlir

from jaxstreams import _compat
from jaxstreams.lower.limits import LoweringError
from jaxstreams.tag.read import sub_jaxprs

# XLA's attribute: the compute stream a call runs on.
STREAM_ANNOTATION = "_xla_stream_annotation"
# Marks the calls jaxstreams emits, so the CPU lowering below touches no others.
# Its value is the index of the plan region the call was emitted for; XLA
# copies it onto the call-start / call-done pair (jaxstreams.xla_schedule).
REGION_ATTRIBUTE = "jaxstreams_region"
# Marks jaxstreams' ordering barriers (``order_barrier``).
ORDER_ATTRIBUTE = "jaxstreams_order"
# Marks a region call that the installed XLA:GPU cannot compile: lowering
# it for a GPU raises jaxstreams.LoweringError with the attribute's text
# (on CPU it runs in place, as every region does there).
REFUSED_ATTRIBUTE = "jaxstreams_refused"
# The name scope around each region's equations. XLA keeps it in each
# instruction's op_name, so a kernel of a region emitted in place (no call
# of its own) is still traced back to its plan region (jaxstreams.xla_graphs).
REGION_SCOPE = "jaxstreams_region_{index}"
# Marks a region call already lowered through the GPU rule below.
_PREPARED_ATTRIBUTE = "jaxstreams_prepared"


def xla_stream(region_streams: Sequence[int], stream: int) -> int:
  """The XLA:GPU compute stream a region of plan stream ``stream`` runs on,
  given every region's plan stream (``RegionGraph.streams``): the plan's
  off-main streams numbered from 1 in order. The plan's ids are the
  user's, and XLA numbers real streams: a program with stream id 10**6 ran
  out of GPU memory on an H100 (jax 0.11.2)."""
  used = sorted({s for s in region_streams if s != 0})
  return used.index(stream) + 1


def region_scope(index: int):
  """The name scope of region ``index``'s work (``REGION_SCOPE``)."""
  return jax.named_scope(REGION_SCOPE.format(index=index))


def stream_call(fn: Callable[..., Any], stream_id: int, region: int,
                refused: str | None = None) -> Callable[..., Any]:
  """``fn`` as one non-inlineable call that XLA:GPU runs on stream
  ``stream_id``, tagged with the index of the plan ``region`` it is.
  ``refused``: why XLA:GPU cannot compile it (lowering it for a GPU then
  raises that)."""
  attributes = {STREAM_ANNOTATION: str(stream_id), "inlineable": "false",
                REGION_ATTRIBUTE: str(region)}
  if refused is not None:
    attributes[REFUSED_ATTRIBUTE] = refused
  return _compat.xla_metadata_call(fn, **attributes)


def order_barrier(values: Sequence[Any]) -> list[Any]:
  """``values`` through one optimization barrier in the GPU program: XLA
  computes every value before any result is read. On CPU the call lowers to
  nothing (the values pass through), so CPU programs stay those jax.jit
  builds. Differentiable, batchable and splittable like a region call."""
  def barrier(*xs):
    return list(jax.lax.optimization_barrier(xs))
  return list(_compat.xla_metadata_call(barrier, **{ORDER_ATTRIBUTE: "1"})(
      *values))


# ---------------------------------------------------------------------------
# The rules, installed once.

_region_rules_installed = False


def install_region_rules() -> None:
  """Install, once, what jaxstreams' region calls need from jax: the CPU
  inline lowering, the GPU lowering that gives XLA calls it compiles, and
  a partial-evaluation rule that splits a region's
  primal work from its linear work (``jax.checkpoint`` needs it). Calls that
  are not jaxstreams regions keep jax's own rules."""
  global _region_rules_installed
  if _region_rules_installed:
    return
  _install_cpu_inline_lowering()
  _install_gpu_region_lowering()
  _install_region_partial_eval()
  _region_rules_installed = True


def _region_primitive():
  """The primitive of jax's ``xla_metadata_call``, which region calls and
  barriers bind."""
  probe = jax.make_jaxpr(_compat.xla_metadata_call(lambda x: x, probe="1"))(1.0)
  return probe.jaxpr.eqns[0].primitive


def _install_cpu_inline_lowering() -> None:
  """On CPU, lower jaxstreams' region calls inline.

  XLA:CPU has one stream, so a region call buys nothing there, and a call
  boundary that XLA may not inline blocks algebraic rewrites across it
  (``(x * 2) * y`` reassociated, say), which changes the last bits of some
  results. Inline, the CPU program is the one ``jax.jit`` would build, and
  its results are bitwise the same. ``order_barrier`` calls lower to
  nothing on CPU, for the same reason. GPU lowering is untouched, and
  lowering for a GPU from a CPU-only machine (``lowering_platforms=("cuda",)``)
  still shows the annotated calls and the barriers.
  """
  primitive = _region_primitive()
  default_rule = _compat.default_lowering(primitive)

  def cpu_rule(ctx, *args, jaxpr, **params):
    metadata = _compat.call_metadata(params)
    if ORDER_ATTRIBUTE in metadata:   # a barrier orders nothing on one stream
      return jax.interpreters.mlir.lower_fun(
          _without_barriers(jaxpr), multiple_results=True)(ctx, *args)
    if REGION_ATTRIBUTE in metadata:
      return jax.interpreters.mlir.lower_fun(
          jcore.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)
    return default_rule(ctx, *args, jaxpr=jaxpr, **params)

  jax.interpreters.mlir.register_lowering(primitive, cpu_rule, platform="cpu")


def _without_barriers(closed) -> Callable[..., list]:
  """``closed`` (an order_barrier's body, outputs perhaps pruned by jax's
  dead-code elimination) as a function whose optimization barriers pass
  their operands through."""
  jaxpr = closed.jaxpr

  def run(*args):
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      if eqn.primitive is jax.lax.optimization_barrier_p:
        outs = ins
      else:
        outs = eqn.primitive.bind(*ins, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
  return run


def _install_gpu_region_lowering() -> None:
  """Lower jaxstreams' region calls for CUDA as XLA compiles them.

  * A result that is one of the call's operands, passed through (jax's
    differentiation makes such results), is taken from the operand
    instead: XLA 0.10 can fuse the copy it makes of such a result into a
    cycle ("A cycle is detected while visiting instruction").
  * From jaxlib 0.12 (``_compat.CALLS_RUN_ON_PARALLEL_THREAD``), what the
    call computes from constants and literals alone (values jax's
    differentiation makes, a user's constants) is computed before it and
    passed in, and every operand passes an optimization barrier, so that
    XLA neither folds a constant into the call nor copies a constant
    operand into it. Constants that stay inside are literals of
    elementwise work, which XLA fuses into kernels.

  The call itself is lowered by jax's rule.
  """
  primitive = _region_primitive()
  default_rule = _compat.default_lowering(primitive)

  def gpu_rule(ctx, *args, jaxpr, **params):
    metadata = _compat.call_metadata(params)
    if REFUSED_ATTRIBUTE in metadata:
      raise LoweringError(metadata[REFUSED_ATTRIBUTE])
    if REGION_ATTRIBUTE not in metadata:
      return default_rule(ctx, *args, jaxpr=jaxpr, **params)
    if _PREPARED_ATTRIBUTE in metadata:
      return _compat.results_through_one_tuple(
          ctx, default_rule(ctx, *args, jaxpr=jaxpr, **params))
    run = _prepared_call(jaxpr, {**metadata, _PREPARED_ATTRIBUTE: "1"})
    return jax.interpreters.mlir.lower_fun(run, multiple_results=True)(
        ctx, *args)

  for platform in ("cuda", "rocm"):
    jax.interpreters.mlir.register_lowering(primitive, gpu_rule,
                                            platform=platform)


def _prepared_call(closed, metadata: dict) -> Callable[..., list]:
  """A function of the call's operands running ``closed`` as a region call
  (attributes ``metadata``), its forwarded results taken from the operands
  and, from jaxlib 0.12, its constant work outside and its operands behind
  one optimization barrier."""
  jaxpr = closed.jaxpr
  hoist = _compat.CALLS_RUN_ON_PARALLEL_THREAD
  # Values computed before the call: its constants, and from jaxlib 0.12
  # what it makes from constants and literals alone.
  outside = set(jaxpr.constvars)
  hoisted, kept = [], []
  for eqn in jaxpr.eqns:
    if (hoist and not eqn.effects and not sub_jaxprs(eqn) and all(
        isinstance(v, jcore.Literal) or v in outside for v in eqn.invars)):
      outside.update(eqn.outvars)
      hoisted.append(eqn)
    else:
      kept.append(eqn)
  operand_of = {v: k for k, v in enumerate(jaxpr.invars)}
  passed = list(dict.fromkeys(   # computed before, read inside
      v for eqn in kept for v in eqn.invars
      if not isinstance(v, jcore.Literal) and v in outside))
  returned = [v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)
              and v in outside]   # computed before, a result
  before = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(_compat.make_jaxpr(
      jaxpr.constvars, [*passed, *returned], hoisted), ()))
  results_inside = [v for v in jaxpr.outvars
                    if not isinstance(v, jcore.Literal) and v not in outside
                    and v not in operand_of]
  call = _compat.xla_metadata_call(jcore.jaxpr_as_fun(jcore.ClosedJaxpr(
      _compat.make_jaxpr([*passed, *jaxpr.invars], results_inside, kept), ())),
      **metadata)

  def run(*args):
    made = before(*closed.consts)
    env = dict(zip([*passed, *returned], made))
    operands = [*made[:len(passed)], *args]
    if hoist and operands:
      operands = jax.lax.optimization_barrier(operands)
    env.update(zip(results_inside,
                   call(*operands) if results_inside else ()))
    return [v.val if isinstance(v, jcore.Literal)
            else env[v] if v in env else args[operand_of[v]]
            for v in jaxpr.outvars]
  return run


def _install_region_partial_eval() -> None:
  """Split region calls by data dependence when they are partially evaluated.

  ``jax.checkpoint`` transposes its body by first separating the work it
  can recompute (known) from the linear work (unknown). jax 0.10 gives
  ``xla_metadata_call`` no rule for that step, so a region call with any
  unknown input is staged whole and its primal outputs count as linear:
  a later product of two primals then fails to transpose (``AssertionError:
  (ValAccum, ValAccum)``) under ``jax.checkpoint``. This rule splits the
  region into a known region call and an unknown one, both on the region's
  stream, as jax does for its own call primitives (an ``order_barrier`` into
  two barriers). Calls that are not jaxstreams' keep jax's behaviour.
  """
  def ours(params: dict) -> bool:
    metadata = _compat.call_metadata(params)
    return REGION_ATTRIBUTE in metadata or ORDER_ATTRIBUTE in metadata

  _compat.split_calls_by_known_inputs(_region_primitive(), ours)
