"""What ``jax.jit`` traces for a ``jaxstreams.jit`` function, and the plans
its programs share.

A ``jaxstreams.jit`` function (``_jit.py``) calls ``jax.jit`` functions of a
*staged* function (``Staged``): traced by ``jax.jit`` once per set of
shapes, dtypes and static values, it traces the user's function to a
jaxpr, runs the pipeline on it (tag -> assign -> partition; ``make_plan``)
and emits the planned program (``jaxstreams.lower.emit``). One staged
function per (function, stream count, options, program) is shared by every
``jaxstreams.jit`` of that function, as ``jax.jit(f)``'s caches are; the
plans (``Plans``) are shared by all its programs, so the user's function
is traced once per signature.
"""

from __future__ import annotations

import collections
import inspect
import threading
import weakref
from typing import Any, Callable

import jax
from jax import tree_util

from jaxstreams import _compat, _pipeline, config
from jaxstreams._trace import trace
from jaxstreams.lower.emit import emit
from jaxstreams.partition import PartitionedProgram
from jaxstreams.runtime.profile import profiling_now


class Staged:
  """The function ``jax.jit`` traces: the user's function, planned and
  emitted. One per (function, stream count, options, program), shared by
  every ``jaxstreams.jit`` of that function, so jax's caches (keyed by this
  object) are shared as ``jax.jit(f)``'s are. It holds the user's function
  weakly: the shared table maps the function to it, and a strong reference
  would keep the function alive forever. The ``jaxstreams.jit`` functions
  handed to users hold the function strongly."""

  def __init__(self, fun: Callable, streams: int, spread: bool | None,
               source: str, program: str, shared: bool, plans: "Plans",
               strict: bool = False):
    self.plans = plans   # shared with the function's other programs
    self.strict = strict   # a way asked for: refuse regions XLA cannot compile
    if shared:
      self._fun_ref = weakref.ref(fun)
    else:   # held by its jit object only: no cycle, hold the function
      self._fun_ref = lambda fun=fun: fun
    self.streams = streams
    self.spread = spread
    self.source = source
    self.program = program
    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
      value = getattr(fun, name, None)
      if isinstance(value, str):
        setattr(self, name, value)
    if "__name__" not in self.__dict__:   # a partial: jax's name for it
      self.__name__ = _compat.function_name(fun)
    try:
      self.__signature__ = inspect.signature(fun)
    except (TypeError, ValueError):
      pass

  @property
  def __wrapped__(self) -> Callable:
    """The user's function: jax names a traced function after what
    ``inspect.unwrap`` finds (its name and source line in cache-miss
    explanations, the lowered module's name), as for ``jax.jit(fun)``."""
    return self._fun_ref()

  def __call__(self, *args, **kwargs):
    fun = self._fun_ref()
    if jax.config.jax_disable_jit or _compat.at_top_level():
      # Under jax.disable_jit() jax.jit runs the function as plain Python;
      # so do we (stream() blocks are then name scopes that do nothing).
      # Outside any trace jax itself is calling the function as if the jit
      # were removed: under jax_debug_nans, after a compiled call made a
      # NaN, to re-run it op by op and name the primitive that made it.
      return fun(*args, **kwargs)
    plan, out_tree, dynamic = make_plan(fun, self.streams, self.spread,
                                        self.source, args, kwargs, self.plans)
    outs = emit(plan, dynamic, profile=profiling_now(),
                gpu_lowering=self.program, strict=self.strict)
    return tree_util.tree_unflatten(out_tree, outs)


class Plans:
  """The plans of one function (at one stream count and set of options), by
  the signature it was traced with, shared by all its programs.

  On a GPU one function has several ``jax.jit`` functions (one per way: the
  top-level one with its compiler options, the one for calls inside another
  jit, the candidates the first call times) and jax traces each apart.
  They find the plan here, so the user's function is traced once per
  signature, as under ``jax.jit``. The key is what jax's own trace cache
  keys on that can differ between them: the argument tree, the avals, the
  static values (with their types), jax's trace context, and the
  jaxstreams options the plan was made with. The newest ``SIZE`` plans are
  kept, and ``jax.clear_caches()`` clears them with jax's own, so a
  function traced again after it sees what it reads then.
  """

  SIZE = 64

  def __init__(self):
    self._lock = threading.Lock()
    self._plans: "collections.OrderedDict[Any, tuple]" = (
        collections.OrderedDict())
    # What a plan implies, by (signature, question): whether a nested
    # program emits jax.jit's (StreamJit._nested_emits_inline).
    self.facts: dict[Any, Any] = {}
    _compat.register_cache(self, "jaxstreams plans")

  def cache_clear(self) -> None:
    with self._lock:
      self._plans.clear()
      self.facts.clear()

  @staticmethod
  def key(args, kwargs, options) -> Any:
    """The key of a trace with these arguments, or None where a static
    value cannot be hashed (then the plan is not kept)."""
    leaves, tree = tree_util.tree_flatten((args, kwargs))
    parts = tuple(("traced", leaf.aval) if isinstance(leaf, jax.core.Tracer)
                  else ("static", type(leaf), leaf) for leaf in leaves)
    key = (tree, parts, _compat.trace_context(), options)
    try:
      hash(key)
    except TypeError:
      return None
    return key

  def get(self, key) -> tuple | None:
    if key is None:
      return None
    with self._lock:
      entry = self._plans.get(key)
      if entry is not None:
        self._plans.move_to_end(key)
      return entry

  def put(self, key, plan: PartitionedProgram, out_tree) -> None:
    if key is None:
      return
    with self._lock:
      self._plans[key] = (plan, out_tree)
      while len(self._plans) > self.SIZE:
        self._plans.popitem(last=False)


# function -> {(streams, spread, source, program, strict): Staged,
#              (streams, spread, source): Plans}, the function held weakly.
_STAGED: "weakref.WeakKeyDictionary[Callable, dict]" = (
    weakref.WeakKeyDictionary())
_STAGED_LOCK = threading.Lock()


def _shared(fun: Callable) -> dict | None:
  """``fun``'s entry in ``_STAGED`` (hold ``_STAGED_LOCK``), or None where
  it cannot share one. Only callables compared by identity share: an equal
  but distinct callable (a bound method made again) would find the entry of
  one that may die before it. A callable that cannot be weakly referenced
  raises jax.jit's TypeError (jax's trace cache holds functions weakly, so
  a ``jax.jit`` of one fails at its first call too)."""
  if type(fun).__eq__ is not object.__eq__:
    return None
  return _STAGED.setdefault(fun, {})


def staged_for(fun: Callable, streams: int, spread: bool | None,
                source: str, program: str, plans: Plans,
                strict: bool = False) -> Staged:
  """The shared staged function of ``fun`` for ``program``, with the
  function's shared ``plans``; a function that cannot share one gets its
  own. ``strict``: the way was asked for, and a region XLA cannot compile
  that way is an error rather than emitted in place."""
  args = (streams, spread, source, program)
  with _STAGED_LOCK:
    by_key = _shared(fun)
    if by_key is None:
      return Staged(fun, *args, shared=False, plans=plans, strict=strict)
    key = (*args, strict, _options_now())
    staged = by_key.get(key)
    if staged is None:
      staged = by_key[key] = Staged(
          fun, *args, shared=True, plans=plans, strict=strict)
    return staged


# Options read while planning and lowering (not part of a function's own
# settings): a program or plan made under other values is not shared with
# a function made after they changed.
_PROGRAM_OPTIONS = ("jaxstreams_spread", "jaxstreams_forward_propagation",
                    "jaxstreams_stream_from_file",
                    "jaxstreams_reduce_stream_wait",
                    "jaxstreams_sequence_points")


def _options_now() -> tuple:
  return tuple(config.read(name) for name in _PROGRAM_OPTIONS)


def plans_for(fun: Callable, streams: int, spread: bool | None, source: str,
               own: dict) -> Plans:
  """The plans every program of ``fun`` at these settings shares: in
  ``_STAGED`` where ``fun`` can share, else in ``own`` (its
  ``jaxstreams.jit``'s)."""
  key = (streams, spread, source, _options_now())
  with _STAGED_LOCK:
    by_key = _shared(fun)
    table = own if by_key is None else by_key
    plans = table.get(key)
    if plans is None:
      plans = table[key] = Plans()
    return plans


def make_plan(fun: Callable, streams: int, spread: bool | None, source: str,
              args, kwargs, plans: Plans | None = None
              ) -> tuple[PartitionedProgram, Any, list]:
  """Trace the user function on the traced arguments and plan it: the
  partitioned program (what ``emit`` lowers), the output tree and the
  traced arguments in flat order. With ``plans``, a plan made for the same
  signature is used instead of tracing again.

  Called inside a ``jax.jit`` trace: array arguments are tracers, static
  arguments are the values themselves and stay baked in, as in jax.jit.
  """
  options = _pipeline.options_from_config(spread)
  key = plans.key(args, kwargs, options) if plans is not None else None
  known = plans.get(key) if plans is not None else None
  if known is not None:
    plan, out_tree = known
    dynamic = [leaf for leaf in tree_util.tree_leaves((args, kwargs))
               if isinstance(leaf, jax.core.Tracer)]
    return plan, out_tree, dynamic
  closed, dynamic, out_tree = trace(
      fun, args, kwargs, traced=lambda leaf: isinstance(leaf, jax.core.Tracer))
  plan = _pipeline.plan_program(closed, streams, source, qualified_name(fun),
                                options)
  if plans is not None:
    plans.put(key, plan, out_tree)
  return plan, out_tree, dynamic


def qualified_name(fun: Callable) -> str:
  """The name plans and errors give ``fun``."""
  return getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None) \
      or repr(fun)
