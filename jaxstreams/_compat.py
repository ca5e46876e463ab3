"""Everything that depends on a JAX version or on JAX internals, in one place.

jaxstreams supports jax 0.10 (what pip resolves on Python 3.11), jax 0.11
(the GPU machines' image) and jax 0.12 (what pip resolves on Python 3.12 and
3.13). The rest of the package imports JAX internals only through this
module, so a JAX upgrade touches one file.

What lives here, and why it cannot use a public API:

* ``stream_call``: wraps a function so that it lowers to one ``call`` op with
  the frontend attributes ``_xla_stream_annotation`` and ``inlineable``. JAX
  exposes this as ``xla_metadata_call`` (``jax.experimental.scheduling_groups``
  in 0.10, ``jax.experimental.xla_metadata`` from 0.11), a primitive with the
  full set of jvp / linearize / transpose / batching / DCE rules, so regions
  stay regions under ``jax.grad`` and ``jax.vmap`` applied outside.
  ``order_barrier`` is the same primitive around ``optimization_barrier``.
* ``XLA_SCHEDULES_STREAM_CALLS``: whether the XLA inside this jaxlib
  schedules work between a stream call's start and done by itself.
* name stacks and source locations of equations (``eqn.source_info``): the
  carrier of ``jaxstreams.stream`` tags.
* making fresh ``Var`` s and ``Jaxpr`` s when regions are cut out of a jaxpr
  (from 0.11 ``Jaxpr`` and ``ClosedJaxpr`` are one class, and a jaxpr's
  constants are the inputs that carry values: ``make_jaxpr`` hides that).
* ``shard_map`` bodies: the body of a ``shard_map`` equation, whether it
  is over its whole mesh, and binding it again with another body (through
  the public ``jax.shard_map``, from the equation's parameters).
* ``host_array_to_device``: a numpy array onto jax's default device through
  the call ``jax.device_put`` itself ends in, without its Python layers
  (prefetch places every item with it).
* ``ARRAY_TYPE``: the concrete class of jax arrays, for an identity test on
  a per-request path (``isinstance(x, jax.Array)`` goes through a Python
  ``__instancecheck__``).
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.extend.core as jcore
import jax.interpreters.mlir
import jaxlib
from jax import tree_util
from jax.extend import source_info_util

# The name jax gives the nested-jit primitive: "pjit" before 0.8, "jit" since.
NESTED_JIT_PRIMITIVES = frozenset({"pjit", "jit", "closed_call", "core_call"})


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
      f"jaxstreams needs jax's xla_metadata_call (jax.experimental.xla_metadata "
      f"or jax.experimental.scheduling_groups); jax {jax.__version__} has neither. "
      "Install jax>=0.10.")


_xla_metadata_call = _find_xla_metadata_call()

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
  return _xla_metadata_call(fn, **attributes)


def _version_tuple(text: str) -> tuple[int, ...]:
  parts = []
  for part in text.split(".")[:2]:
    digits = "".join(ch for ch in part if ch.isdigit())
    parts.append(int(digits or 0))
  return tuple(parts)


def jaxlib_version() -> tuple[int, ...]:
  """The installed jaxlib's (major, minor): what XLA can compile depends on it."""
  return _version_tuple(jaxlib.__version__)


def jaxlib_text() -> str:
  return jaxlib.__version__


# Whether XLA's latency-hiding scheduler sees the calls stream_call makes.
# Measured in deviceless H100 compiles (README "What XLA will run"): from
# jaxlib 0.12 XLA wraps an annotated call as an async pair on the "parallel"
# execution thread, which its GPU async tracker counts as async compute, and
# it schedules work between call-start and call-done. In jaxlib 0.10 and 0.11
# the pair stays on the main thread, the tracker does not count it, the
# latency-hiding scheduler leaves the computation as the memory scheduler
# ordered it, and only the order jaxstreams emits can open a window
# (lower/emit.py, sequence points).
XLA_SCHEDULES_STREAM_CALLS = jaxlib_version() >= (0, 12)


def order_barrier(values: Sequence[Any]) -> list[Any]:
  """``values`` through one optimization barrier in the GPU program: XLA
  computes every value before any result is read. On CPU the call lowers to
  nothing (the values pass through), so CPU programs stay those jax.jit
  builds. Differentiable, batchable and splittable like a region call."""
  def barrier(*xs):
    return list(jax.lax.optimization_barrier(xs))
  return list(_xla_metadata_call(barrier, **{ORDER_ATTRIBUTE: "1"})(*values))


def _metadata_of(params: dict) -> dict[str, str]:
  """The frontend attributes of an xla_metadata_call equation: jax 0.10 keeps
  them as keyword params, later versions as an ``xla_metadata`` tuple."""
  if "xla_metadata" in params:
    return dict(params["xla_metadata"])
  return {k: v for k, v in params.items() if isinstance(v, str)}


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
  probe = jax.make_jaxpr(stream_call(lambda x: x, 1, 0))(1.0)
  primitive = probe.jaxpr.eqns[0].primitive
  from jax._src.interpreters import mlir as mlir_internal  # the default rule
  entry = mlir_internal._lowerings[primitive]
  default_rule = getattr(entry, "rule", entry)   # a LoweringRuleEntry since 0.9

  def cpu_rule(ctx, *args, jaxpr, **params):
    metadata = _metadata_of(params)
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


# ---------------------------------------------------------------------------
# Name stacks and source locations.

def name_stack_entries(eqn) -> tuple[tuple[str, str], ...]:
  """The equation's name stack, outermost first, as ("scope"|"transform", name)."""
  entries = []
  for entry in eqn.source_info.name_stack.stack:
    kind = "transform" if type(entry).__name__ == "Transform" else "scope"
    entries.append((kind, entry.name))
  return tuple(entries)


def name_stack_str(eqn) -> str:
  return str(eqn.source_info.name_stack)


def with_outer_name_stack(eqn, outer_eqn):
  """``eqn`` (from a nested jaxpr) with ``outer_eqn``'s name stack prefixed."""
  stack = outer_eqn.source_info.name_stack + eqn.source_info.name_stack
  return eqn.replace(source_info=eqn.source_info.replace(name_stack=stack))


def source_location(eqn) -> str:
  """``file:line (function)`` of the user code that created ``eqn``."""
  try:
    return source_info_util.summarize(eqn.source_info)
  except Exception:  # a summary is a courtesy; never fail a plan over it
    return "<unknown>"


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Source locations in plans and errors should point at user code, not at us.
source_info_util.register_exclusion(_PACKAGE_DIR)


# ---------------------------------------------------------------------------
# Building jaxprs.

def new_var(aval) -> jcore.Var:
  return jcore.Var(aval)


# From jax 0.11, Jaxpr and ClosedJaxpr are one class and a jaxpr's constvars
# are the leading inputs that have values attached: constvars given without
# their values become plain leading invars. Before 0.11 a Jaxpr keeps its
# constvars and the values travel separately (in a ClosedJaxpr).
_JAXPR_HOLDS_CONSTS = jcore.ClosedJaxpr is jcore.Jaxpr


def make_jaxpr(invars: Iterable, outvars: Iterable, eqns: Iterable,
               constvars: Iterable = (), consts: Iterable = ()) -> jcore.Jaxpr:
  """A jaxpr over existing variables and equations (effects joined from eqns).

  ``constvars`` must come with their values ``consts``, so that on every jax
  version the result's ``.constvars`` are ``constvars`` and its ``.invars``
  are ``invars`` (the values are attached where jax needs them to tell the
  two apart; the caller keeps them too, to bind them itself).
  """
  eqns, invars, outvars = list(eqns), list(invars), list(outvars)
  constvars, consts = list(constvars), list(consts)
  if len(constvars) != len(consts):
    raise ValueError(f"make_jaxpr: {len(constvars)} constvars but "
                     f"{len(consts)} values for them")
  effects = set()
  for eqn in eqns:
    effects.update(eqn.effects)
  # Empty names: these arguments have no user-facing names (jax's own
  # convention for arguments it does not track).
  debug = jcore.DebugInfo("jaxstreams", "region", ("",) * len(invars),
                          ("",) * len(outvars))
  if _JAXPR_HOLDS_CONSTS and constvars:
    return jcore.Jaxpr(constvars, invars, outvars, eqns, frozenset(effects),
                       debug, consts=consts)
  return jcore.Jaxpr(constvars, invars, outvars, eqns, frozenset(effects),
                     debug)


def is_unspecified_sharding(sharding: Any) -> bool:
  return type(sharding).__name__ in ("UnspecifiedValue", "NotSpecified")


def jit_params_are_plain(params: dict) -> bool:
  """Whether a nested jit eqn can be inlined without changing its meaning:
  no shardings pinned on its inputs or outputs and no donation."""
  for key in ("in_shardings", "out_shardings"):
    if not all(is_unspecified_sharding(s) for s in params.get(key, ())):
      return False
  return not any(params.get("donated_invars", ()))


_HAS_SUBJAXPRS: dict[Any, bool] = {}


def sub_jaxprs(eqn) -> list:
  """The jaxprs in ``eqn``'s parameters (loop bodies, branches, calls).

  Whether a primitive takes jaxpr parameters does not change from one
  equation to the next, so primitives found to have none are remembered and
  skipped: the generic scan of parameters is a large share of planning time.
  """
  known = _HAS_SUBJAXPRS.get(eqn.primitive)
  if known is False:
    return []
  found = list(jcore.jaxprs_in_params(eqn.params))
  if known is None:
    _HAS_SUBJAXPRS[eqn.primitive] = bool(found) or any(
        isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr, tuple, list))
        for v in eqn.params.values())
  return found


def nested_jaxpr(params: dict):
  """The closed jaxpr a nested-jit / call eqn runs (with ``.jaxpr`` and
  ``.consts``). From jax 0.11 ClosedJaxpr is Jaxpr, consts included."""
  jaxpr = params.get("jaxpr", params.get("call_jaxpr"))
  if isinstance(jaxpr, jcore.ClosedJaxpr):
    return jaxpr
  if isinstance(jaxpr, jcore.Jaxpr):
    return jcore.ClosedJaxpr(jaxpr, ())
  return jaxpr


def scan_counts(params: dict) -> tuple[int, int]:
  """How many of a ``scan`` equation's operands are loop constants and how
  many its carry (the rest are the scanned slices): jax 0.10 names the
  counts ``num_consts`` and ``num_carry``; from 0.11 ``ft_in`` is a flat
  tree of the operands whose ``unpack()`` gives those three groups."""
  if "num_consts" in params:
    return int(params["num_consts"]), int(params["num_carry"])
  groups = params["ft_in"]
  consts, carry, _ = groups.unpack() if hasattr(groups, "unpack") else groups
  return len(consts), len(carry)


# ---------------------------------------------------------------------------
# shard_map bodies: planned on their own, re-emitted through jax.shard_map.

def shard_map_body(eqn):
  """The closed jaxpr of a ``shard_map`` equation's per-device body, or None
  for any other equation."""
  if eqn.primitive.name != "shard_map":
    return None
  return nested_jaxpr(eqn.params)


def shard_map_is_fully_manual(eqn) -> bool:
  """Whether ``eqn`` is a ``shard_map`` over every axis of its mesh: its
  body is each device's whole program, and XLA's partitioner adds nothing
  to it (a collective it added inside a stream call would not compile)."""
  if eqn.primitive.name != "shard_map":
    return False
  return (set(eqn.params["newly_manual_axes"])
          == set(eqn.params["mesh"].axis_names))


def varying_axes(aval) -> frozenset:
  """The mesh axes a value inside a shard_map body varies over (jax's
  ``{V:...}`` type annotation); empty outside shard_map."""
  return getattr(getattr(aval, "mat", None), "varying", None) or frozenset()


# jax 0.10's optimization_barrier gives every result the varying axes of all
# its operands together (measured: an invariant value through a barrier
# beside a varying one came out varying); from 0.11 each keeps its own.
BARRIER_JOINS_VARYING_AXES = _version_tuple(jax.__version__) < (0, 11)


def bind_shard_map(eqn, body: Callable[..., Sequence[Any]],
                   args: Sequence[Any]) -> list[Any]:
  """Bind ``eqn`` (a ``shard_map`` equation) again on ``args``, with
  ``body`` in place of its jaxpr: the same mesh, specs, manual axes and
  checks, through the public ``jax.shard_map``, under the equation's own
  name stack and source line (as ``jax.core.eval_jaxpr`` binds)."""
  params = eqn.params
  mapped = jax.shard_map(
      lambda *xs: tuple(body(*xs)), mesh=params["mesh"],
      in_specs=tuple(params["in_specs"]), out_specs=tuple(params["out_specs"]),
      axis_names=set(params["newly_manual_axes"]),
      check_vma=params["check_vma"])
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with source_info_util.user_context(eqn.source_info.traceback,
                                     name_stack=name_stack):
    return list(mapped(*args))


# ---------------------------------------------------------------------------
# Region-call rules for jaxstreams.jit as a drop-in for jax.jit.
# Installed by the first emission of a region (``install_region_rules``), not
# at import: importing jaxstreams changes nothing in jax.

_region_rules_installed = False


def _find_top_level_check() -> Callable[[], bool]:
  from jax._src import core
  return core.trace_state_clean


# Whether no trace is active: a call here is a top-level call, which jax
# compiles itself (and where it accepts compiler options). jax.grad, jax.vmap
# and an enclosing jit each make the call a traced one.
at_top_level = _find_top_level_check()


def trace_context() -> Any:
  """The configuration jax's own trace cache is keyed on (x64, default
  precision, abstract mesh, axis environment, ...)."""
  from jax._src import config as jax_config
  return jax_config.trace_context()


def register_cache(cache: Any, for_what: str) -> None:
  """Have ``jax.clear_caches()`` call ``cache.cache_clear()`` (held weakly),
  as it does for jax's own trace caches."""
  from jax._src import util
  util.register_cache(cache, for_what)


def trace_to_jaxpr(fun: Callable, args: tuple, kwargs: dict,
                   static_argnums: Sequence[int], static_argnames: Sequence[str]
                   ) -> tuple[Any, list, Any]:
  """``fun(*args, **kwargs)`` traced to a closed jaxpr, once, outside jax's
  trace cache: ``(closed, inputs, out_tree)``, the inputs being the leaves
  of the arguments not named static, in the jaxpr's order.

  ``jaxstreams.jit`` traces the user's function inside the trace ``jax.jit``
  makes of its staged function. ``jax.make_jaxpr`` would make that a second
  jit trace, cached (under a key nobody asks for again) and counted as a
  trace-cache miss: jax's own accounting would see two traces where
  ``jax.jit`` makes one. This is the uncached tracer jax's own control flow
  uses for its bodies. The debug info is a jit's, so tracing errors name
  the function, its arguments and ``jit`` as ``jax.jit``'s do.
  """
  from jax._src import api_util
  from jax._src import core
  from jax._src import linear_util as lu
  from jax._src.interpreters import partial_eval as pe
  static_argnums = frozenset(static_argnums)
  static_kwargs = {k: v for k, v in kwargs.items() if k in static_argnames}
  dynamic_args = tuple(a for i, a in enumerate(args) if i not in static_argnums)
  dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in static_kwargs}

  debug = api_util.debug_info("jit", fun, args, kwargs,
                              static_argnums=tuple(static_argnums),
                              static_argnames=tuple(static_kwargs))
  result_paths: list[str] = []   # the outputs' paths, for jax's errors

  def with_statics(*dynamic, **dynamic_kw):
    given = iter(dynamic)
    full = [arg if i in static_argnums else next(given)
            for i, arg in enumerate(args)]
    answer = fun(*full, **static_kwargs, **dynamic_kw)
    result_paths[:] = debug.set_result_paths(answer).result_paths
    return answer

  inputs, in_tree = tree_util.tree_flatten((dynamic_args, dynamic_kwargs))
  flat_fun, out_tree = api_util.flatten_fun(
      lu.wrap_init(with_statics, debug_info=debug), in_tree)
  flat_fun = flat_fun.replace_debug_info(
      debug._replace(result_paths=lambda: tuple(result_paths)))
  jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
      flat_fun, [core.shaped_abstractify(x) for x in inputs])
  closed = (jaxpr.with_consts(consts) if _JAXPR_HOLDS_CONSTS
            else jcore.ClosedJaxpr(jaxpr, consts))
  return closed, inputs, out_tree()


def count_jax_events(event: str):
  """A context that counts jax's internal test event ``event`` while open
  and yields a function giving the count so far: ``"trace_to_jaxpr"``
  (every jit trace, nested ones included: a miss of jax's trace cache) or
  ``"lower_jaxpr_to_module"`` (a lowering). What jax's own tests count;
  for jaxstreams' tests and benchmarks, which hold it to ``jax.jit``'s
  counts. jax's public monitoring events skip nested traces."""
  from jax._src import test_util
  return test_util.count_events(event)()


def jit_cpp_cache() -> Any:
  """The C++ call cache ``jax.jit`` functions made now would use (the
  ``jax_jit_cpp_cache_obj`` context; None: jax's global one)."""
  from jax._src import config as jax_config
  return jax_config.jax_jit_cpp_cache_obj.value


def using_jit_cpp_cache(cache: Any):
  """A context in which ``jax.jit`` functions are made with ``cache``."""
  from jax._src import config as jax_config
  return jax_config.jax_jit_cpp_cache_obj(cache)


def function_name(fun: Callable) -> str:
  """The name jax gives ``fun`` (a partial: its function's)."""
  from jax._src import util
  return util.fun_name(fun)


def jit_disabled() -> bool:
  """Whether ``jax.disable_jit()`` is in force."""
  return bool(jax.config.jax_disable_jit)


_package_frames_hidden = False


def api_boundary(fun: Callable) -> Callable:
  """``fun`` as a boundary of jax's traceback filtering (as jax marks
  ``jax.jit`` functions): an error raised below it reaches the user with
  jax's and jaxstreams' frames filtered out. Internal to jax."""
  from jax._src import traceback_util
  return traceback_util.api_boundary(fun)


def hide_package_frames() -> None:
  """Filter jaxstreams' own frames from the tracebacks of errors raised in a
  user's function, as jax filters its own (``JAX_TRACEBACK_FILTERING=off``
  shows them again). jax offers no public way to add a path, so this goes
  through ``jax._src.traceback_util``; called by ``jaxstreams.jit``."""
  global _package_frames_hidden
  if _package_frames_hidden:
    return
  from jax._src import traceback_util
  traceback_util.register_exclusion(_PACKAGE_DIR)
  _package_frames_hidden = True


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


# From jaxlib 0.12 XLA compiles an annotated call on its "parallel"
# execution thread, where it neither sanitizes constants' names nor runs the
# passes that remove optimization barriers: a constant inside a stream call
# crashes its compiler (a segmentation fault, or ptxas rejecting the name).
CALLS_RUN_ON_PARALLEL_THREAD = jaxlib_version() >= (0, 12)
# Marks a region call already lowered through the rule below.
_PREPARED_ATTRIBUTE = "jaxstreams_prepared"


def _install_gpu_region_lowering() -> None:
  """Lower jaxstreams' region calls for CUDA as XLA compiles them.

  * A result that is one of the call's operands, passed through (jax's
    differentiation makes such results), is taken from the operand
    instead: XLA 0.10 can fuse the copy it makes of such a result into a
    cycle ("A cycle is detected while visiting instruction").
  * From jaxlib 0.12, what the call computes from constants and literals
    alone (values jax's differentiation makes, a user's constants) is
    computed before it and passed in, and every operand passes an
    optimization barrier, so that XLA neither folds a constant into the
    call nor copies a constant operand into it. Constants that stay inside
    are literals of elementwise work, which XLA fuses into kernels.

  The call itself is lowered by jax's rule.
  """
  primitive = _region_primitive()
  from jax._src.interpreters import mlir as mlir_internal  # the default rule
  entry = mlir_internal._lowerings[primitive]
  default_rule = getattr(entry, "rule", entry)

  def gpu_rule(ctx, *args, jaxpr, **params):
    metadata = _metadata_of(params)
    if REFUSED_ATTRIBUTE in metadata:
      from jaxstreams.lower.limits import LoweringError
      raise LoweringError(metadata[REFUSED_ATTRIBUTE])
    if REGION_ATTRIBUTE not in metadata or _PREPARED_ATTRIBUTE in metadata:
      return default_rule(ctx, *args, jaxpr=jaxpr, **params)
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
  # Values computed before the call: its constants, and from jaxlib 0.12
  # what it makes from constants and literals alone.
  outside = set(jaxpr.constvars)
  hoisted, kept = [], []
  for eqn in jaxpr.eqns:
    if (CALLS_RUN_ON_PARALLEL_THREAD and not eqn.effects
        and not sub_jaxprs(eqn) and all(
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
  before = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(make_jaxpr(
      jaxpr.constvars, [*passed, *returned], hoisted), ()))
  results_inside = [v for v in jaxpr.outvars
                    if not isinstance(v, jcore.Literal) and v not in outside
                    and v not in operand_of]
  call = _xla_metadata_call(jcore.jaxpr_as_fun(jcore.ClosedJaxpr(
      make_jaxpr([*passed, *jaxpr.invars], results_inside, kept), ())),
      **metadata)

  def run(*args):
    made = before(*closed.consts)
    env = dict(zip([*passed, *returned], made))
    operands = [*made[:len(passed)], *args]
    if CALLS_RUN_ON_PARALLEL_THREAD and operands:
      operands = jax.lax.optimization_barrier(operands)
    env.update(zip(results_inside,
                   call(*operands) if results_inside else ()))
    return [v.val if isinstance(v, jcore.Literal)
            else env[v] if v in env else args[operand_of[v]]
            for v in jaxpr.outvars]
  return run


def _region_primitive():
  probe = jax.make_jaxpr(_xla_metadata_call(lambda x: x, probe="1"))(1.0)
  return probe.jaxpr.eqns[0].primitive


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
  from jax._src.interpreters import partial_eval as pe
  primitive = _region_primitive()
  if primitive in pe.custom_partial_eval_rules:
    return   # a jax with its own rule

  def partial_eval(trace, *tracers, jaxpr, **params):
    metadata = _metadata_of(params)
    if REGION_ATTRIBUTE not in metadata and ORDER_ATTRIBUTE not in metadata:
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


# ---------------------------------------------------------------------------
# Host arrays onto the default device (``jaxstreams.prefetch``'s placement).
# jax.device_put of a numpy array ends in jaxlib's ``batched_device_put``;
# the Python layers above it (tree handling, sharding resolution, deferred
# shard arguments) cost about 20 us per array on jax 0.10.2 / XLA:CPU where
# the call itself takes about 3 us (a 16x32 float32, measured on the 2-core
# development machine). The same signature on 0.10.2, 0.11.2 and 0.12.0.1.

def _find_batched_device_put():
  try:
    from jax._src import config
    from jax._src import core
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client
    return (xla_client.batched_device_put, core.ShapedArray,
            pxla.get_default_device, config.default_device,
            config.enable_x64)
  except (ImportError, AttributeError):
    return None


_batched_device_put = _find_batched_device_put()
# (default-device setting, x64, shape, dtype) -> batched_device_put's leading
# arguments, or None where ``accept`` refused the dtype. The two settings are
# thread-local contexts in jax (``jax.default_device``, x64): reading them is
# a C++ attribute read, where resolving the default device builds a device
# list (about a third of the call's cost on a 16x32 float32).
_placement: dict = {}
_PLACEMENT_MAX = 1024


def host_array_to_device(array: Any, accept: Callable[[Any], bool]) -> Any:
  """``jax.device_put(array)`` for a numpy array: the same uncommitted, not
  weakly typed array on jax's default device, always copied (on jax 0.10.2
  ``jax.device_put`` may alias a small numpy array's memory on CPU; a copy
  leaves the producer free to reuse its buffers). None where this jax lacks
  the internal call, or ``accept(array.dtype)`` is false (a dtype that
  ``jax.device_put`` converts: the caller uses ``jax.device_put`` then);
  ``accept`` runs once per dtype and setting."""
  if _batched_device_put is None:
    return None
  put, shaped_array, default_device, device_setting, x64 = _batched_device_put
  key = (device_setting.value, x64.value, array.shape, array.dtype)
  args = _placement.get(key)
  if args is None:
    if key in _placement:
      return None
    if len(_placement) >= _PLACEMENT_MAX:
      _placement.clear()
    if accept(array.dtype):
      device = default_device()
      args = (shaped_array(array.shape, array.dtype),
              jax.sharding.SingleDeviceSharding(device), [device])
    _placement[key] = args
    if args is None:
      return None
  aval, sharding, devices = args
  return put(aval, sharding, [array], devices, False, True)


def cpu_dispatch_is_async() -> bool:
  """Whether XLA:CPU runs computations on its own threads
  (``jax_cpu_enable_async_dispatch``, on by default; read when the CPU
  client starts). True where this jax does not say."""
  try:
    return bool(jax.config.read("jax_cpu_enable_async_dispatch"))
  except (AttributeError, KeyError, ValueError):
    return True


# ---------------------------------------------------------------------------
# Compiling a lowered program again, elsewhere (the CUDA graph view compiles
# in a child process, where XLA's log is on).

def lowered_compiler_options(lowered) -> dict[str, Any]:
  """The ``compiler_options`` a ``Lowered``'s ``compile()`` will use (those
  of the ``jax.jit`` that lowered it). jax keeps them on its internal
  lowering object; empty where this jax keeps them elsewhere."""
  lowering = getattr(lowered, "_lowering", None)
  return dict(getattr(lowering, "_compiler_options_kvs", ()) or ())


def compile_module_text(text: str, devices, compiler_options: dict) -> Any:
  """Compile the StableHLO module ``text`` (``Lowered.as_text()``) for
  ``devices`` (one per partition, in the module's order) with
  ``compiler_options``, as ``Lowered.compile`` would; returns XLA's
  executable (``hlo_modules()``, ``get_compiled_memory_stats()``). jax has
  no public call that compiles module text, so this goes through the client
  of the devices: for a topology's devices, the compile-only client of
  deviceless compilation."""
  import numpy as np
  from jax._src import compiler
  from jax._src.interpreters import mlir
  from jax._src.lib import xla_client
  from jax._src.lib.mlir import ir
  devices = tuple(devices)
  options = compiler.get_compile_options(
      num_replicas=1, num_partitions=len(devices),
      device_assignment=np.array(devices).reshape(1, -1),
      env_options_overrides=dict(compiler_options))
  if len(devices) > 1:   # the module's shardings partition it, as jax.jit's
    options.executable_build_options.use_spmd_partitioning = True
  with mlir.make_ir_context():
    module = ir.Module.parse(text)
    return devices[0].client.compile(
        module, executable_devices=xla_client.DeviceList(devices),
        compile_options=options)


# ---------------------------------------------------------------------------
# The class of a jax.Array a computation returns (serve's direct path waits
# on a single output without walking it as a tree).

def _find_array_type():
  try:
    from jax._src.array import ArrayImpl
    return ArrayImpl
  except (ImportError, AttributeError):
    return None


ARRAY_TYPE = _find_array_type()


# ---------------------------------------------------------------------------
# The CUDA plugin on a machine without a GPU.

def quiet_cuda_plugin_without_gpu() -> bool:
  """Run jax on CPU where the CUDA plugin is installed but no NVIDIA GPU is
  present and nobody chose the platforms; True where it did.

  The plugin (installed to see what an H100 compiles, without one) makes
  every jax program on such a machine print two tracebacks ("Unable to load
  cuDNN") before jax falls back to the CPU; with the platforms set to the
  CPU, jax goes there directly and prints nothing. Nothing changes where a
  GPU's device files exist, where ``JAX_PLATFORMS`` or ``jax_platforms`` was
  set, or once jax has started a backend.
  """
  if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
    return False
  if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/nvidiactl"):
    return False
  try:
    if importlib.util.find_spec("jax_plugins.xla_cuda13") is None:
      return False
  except ModuleNotFoundError:   # no jax_plugins package at all
    return False
  from jax._src import xla_bridge
  if xla_bridge._backends:   # too late: a backend is running
    return False
  jax.config.update("jax_platforms", "cpu")
  return True
