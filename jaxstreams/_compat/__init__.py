"""Everything that depends on a JAX version or on JAX internals, in one place.

jaxstreams supports jax 0.10 (what pip resolves on Python 3.11), 0.11 (the
GPU machines' image) and 0.12 (what pip resolves on Python 3.12 and 3.13).
The rest of the package reaches JAX internals only through this package, so
a JAX upgrade touches it alone; it imports nothing of jaxstreams outside
itself, and every stage stands on it. Its sections, in order: versions;
calls with frontend attributes (jax's ``xla_metadata_call``, which carries
the region calls of ``jaxstreams.lower.calls``, and how they are lowered:
``_compat.calls``); name stacks and source locations (the carriers
of ``jaxstreams.stream`` tags); building jaxprs and reading equations'
parameters (from 0.11 ``Jaxpr`` and ``ClosedJaxpr`` are one class);
``shard_map`` bodies; tracing, jax's caches and traceback filtering; host
arrays onto a device, module text compiled, the class of jax arrays, the
CUDA plugin on a machine without a GPU.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.extend.core as jcore
import jaxlib
from jax import tree_util
from jax.extend import source_info_util
from jax._src.interpreters.batching import BatchTracer  # vmap's: val, batch_dim

# Calls with frontend attributes (jax's xla_metadata_call, its lowering and
# partial evaluation), in a room of their own.
from jaxstreams._compat.calls import (call_metadata, default_lowering,
                                      results_through_one_tuple,
                                      split_calls_by_known_inputs,
                                      xla_metadata_call)

# ---------------------------------------------------------------------------
# Versions.

def _version_tuple(text: str) -> tuple[int, ...]:
  parts = []
  for part in text.split(".")[:2]:
    digits = "".join(ch for ch in part if ch.isdigit())
    parts.append(int(digits or 0))
  return tuple(parts)


def jaxlib_version() -> tuple[int, ...]:
  """The installed jaxlib's (major, minor): what XLA can compile depends on
  it."""
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
# (lower/order.py, sequence points).
XLA_SCHEDULES_STREAM_CALLS = jaxlib_version() >= (0, 12)
# jaxlib 0.10's scheduler runs a stream call with several results to its
# done before the next call starts, whatever barriers order them; a call
# with one result they pin (tests/test_gpu_view.py).
MULTI_RESULT_CALLS_RUN_IN_TURN = jaxlib_version() < (0, 11)

# From jaxlib 0.12 XLA compiles an annotated call on its "parallel"
# execution thread, where it neither sanitizes constants' names nor runs the
# passes that remove optimization barriers: a constant inside a stream call
# crashes its compiler (a segmentation fault, or ptxas rejecting the name).
CALLS_RUN_ON_PARALLEL_THREAD = jaxlib_version() >= (0, 12)

# jax 0.10's optimization_barrier gives every result the varying axes of all
# its operands together (measured: an invariant value through a barrier
# beside a varying one came out varying); from 0.11 each keeps its own.
BARRIER_JOINS_VARYING_AXES = _version_tuple(jax.__version__) < (0, 11)

# The name jax gives the nested-jit primitive: "pjit" before 0.8, "jit" since.
# "eval_jaxpr" is jax 0.11's closed_call (jax.checkpoint's forward pass
# under jax.grad binds it).
NESTED_JIT_PRIMITIVES = frozenset({"pjit", "jit", "closed_call", "core_call",
                                   "eval_jaxpr"})
# Wrappers whose meaning is how jax differentiates their body
# (nested_jaxpr): jax.checkpoint's, custom_jvp's and custom_vjp's.
CHECKPOINT_PRIMITIVE = "remat2"
DERIVATIVE_WRAPPERS = frozenset({CHECKPOINT_PRIMITIVE, "custom_jvp_call",
                                 "custom_vjp_call"})


# ---------------------------------------------------------------------------
# Name stacks and source locations.

def name_stack_entries(eqn) -> tuple[tuple[str, str], ...]:
  """The equation's name stack, outermost first, as ("scope"|"transform",
  name)."""
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


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def checkpoint_barrier_operands(eqn) -> list[bool]:
  """Per operand of a ``jax.checkpoint`` equation, whether jax lowers it
  through an optimization barrier: in a backward pass's recomputation
  (``differentiated``) with ``prevent_cse`` (one flag; from jax 0.11 also
  one per operand), so XLA cannot merge it with the forward pass."""
  params, count = eqn.params, len(eqn.invars)
  prevent = params.get("prevent_cse", True)
  if not params.get("differentiated", False):
    return [False] * count
  return ([prevent] * count if isinstance(prevent, bool)
          else [bool(p) for p in prevent])


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
  name_stack = (source_info_util.current_name_stack()
                + eqn.source_info.name_stack)
  with source_info_util.user_context(eqn.source_info.traceback,
                                     name_stack=name_stack):
    return list(mapped(*args))


# ---------------------------------------------------------------------------
# Tracing, jax's caches and its traceback filtering.

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
