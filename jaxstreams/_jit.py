"""``jaxstreams.jit``: ``jax.jit`` with a stream plan in the middle.

The wrapper is a ``jax.jit`` of a *staged* function. When ``jax.jit`` traces
the staged function (once per set of shapes, dtypes and static values), it
traces the user's function to a jaxpr, runs the pipeline on it (tag ->
assign -> partition) and emits the planned program (lower). Everything else
is ``jax.jit``'s: the cache, static and donated arguments, shardings, the
C++ fast path on later calls, and transformations applied from outside.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import weakref
from typing import Any, Callable

import jax
from jax import tree_util

from jaxstreams import _checks, _compat, _pipeline, config
from jaxstreams._trace import trace
from jaxstreams.lower import emit
from jaxstreams.partition import PartitionedProgram, StreamPlan, report
from jaxstreams.runtime.profile import profiling_now

__all__ = ["jit", "plan", "spec_of", "StreamJit"]

_JIT_PARAMETERS = frozenset(
    name for name, p in inspect.signature(jax.jit).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)
# What the plan-only trace keeps: it returns nothing, so shardings and
# donation do not apply to it.
_TRACE_ONLY_PARAMETERS = frozenset({"static_argnums", "static_argnames"})


def _check_streams(streams: Any, source: str) -> int:
  return _checks.integer(streams, name="streams", context=source, minimum=1,
                         meaning=" (1 means only the main stream)")


def jit(fun: Callable | None = None, *, streams: int | None = None,
        auto: bool | None = None, gpu_lowering: str | None = None,
        **jit_kwargs: Any):
  """Like ``jax.jit``, with a stream plan of the function's stream blocks.

  Usable as ``@jaxstreams.jit``, ``@jaxstreams.jit(streams=4)`` or
  ``jaxstreams.jit(f, streams=4)``. ``streams`` is the number of stream
  groups (stream ids ``0 .. streams-1``, 0 the main stream); ``None`` reads
  the ``jaxstreams_streams`` option each call, so an absl flag parsed after
  decoration counts. Every other keyword is ``jax.jit``'s (``static_argnums``,
  ``donate_argnums``, ``in_shardings``, ...). The result has ``.lower``,
  ``.trace`` and ``.plan`` and gives exactly the results of ``jax.jit(fun)``.
  ``auto=True`` lets the cost-model scheduler place what no block placed
  (``None`` reads the ``jaxstreams_auto`` option). Plan options are read when
  the function is traced.

  ``gpu_lowering`` is how a plan of several streams runs on a GPU:
  ``"inline"``, the program ``jax.jit`` builds, since stream calls measured
  slower than it on an H100 (jax 0.11.2); ``"streams"``, each off-main
  region as a call on its CUDA stream. ``None`` reads the
  ``jaxstreams_gpu_lowering`` option (default ``"inline"``) when the
  ``jax.jit`` function is made: with ``streams`` given, now. On CPU both are
  the program ``jax.jit`` builds.

  With ``streams`` given, the result *is* a ``jax.jit`` function (of the
  planned program) with a ``plan`` method, so calls cost what ``jax.jit``
  calls cost; with ``streams=None`` it is a thin wrapper that picks the
  ``jax.jit`` function for the option's current value. As with ``jax.jit``,
  wrapping the same function again with the same options reuses its traces
  and compiled programs.
  """
  if streams is not None:
    _check_streams(streams, "jaxstreams.jit")
  if auto is not None and not isinstance(auto, bool):
    raise TypeError(f"jaxstreams.jit: auto must be True, False or None (read "
                    f"the jaxstreams_auto option), got {auto!r}")
  if gpu_lowering is not None and gpu_lowering not in config.GPU_LOWERINGS:
    raise ValueError(f"jaxstreams.jit: gpu_lowering must be one of "
                     f"{', '.join(map(repr, config.GPU_LOWERINGS))} or None "
                     f"(read the jaxstreams_gpu_lowering option), got "
                     f"{gpu_lowering!r}")
  unknown = sorted(set(jit_kwargs) - _JIT_PARAMETERS)
  if unknown:
    raise TypeError(f"jaxstreams.jit got unexpected keyword argument(s) "
                    f"{', '.join(unknown)}; it takes streams=, auto=, "
                    f"gpu_lowering= and the keywords of jax.jit: "
                    f"{', '.join(sorted(_JIT_PARAMETERS))}")
  if fun is None:
    return lambda f: jit(f, streams=streams, auto=auto,
                         gpu_lowering=gpu_lowering, **jit_kwargs)
  _compat.hide_package_frames()
  # jax.jit's own checks and messages for what it does not take (a
  # non-callable, a generator function, bad static_argnums, ...): the
  # function jax.jit traces later is jaxstreams', which would hide them.
  jax.jit(fun, **jit_kwargs)
  if streams is not None and gpu_lowering is None:
    # Its jax.jit function is made now: its plan must report what it runs.
    gpu_lowering = config.read("jaxstreams_gpu_lowering")
  spec = _Spec(fun, streams, auto, dict(jit_kwargs), gpu_lowering)
  if streams is None:
    wrapper = StreamJit(spec)
    wrapper.jitted(1)   # let jax.jit check its keywords now, not at the first call
    return wrapper
  jitted = spec.jitted(streams)
  jitted.plan = spec.plan
  with _SPECS_LOCK:
    _SPECS[jitted] = spec
  return jitted


# The jax.jit functions ``jit`` returned -> what they were made from. The
# entry lives as long as the jax.jit function, and its _Spec holds the user's
# function, which the shared staged function holds only weakly.
_SPECS: "weakref.WeakKeyDictionary[Callable, _Spec]" = weakref.WeakKeyDictionary()
_SPECS_LOCK = threading.Lock()


def spec_of(fun: Any) -> "_Spec | None":
  """What ``jaxstreams.jit`` was given to make ``fun`` (its function,
  ``streams``, ``auto`` and ``jax.jit`` keywords), or None when ``fun`` is
  not a ``jaxstreams.jit`` function. The one way to ask."""
  if isinstance(fun, StreamJit):
    return fun._spec
  try:
    return _SPECS.get(fun)
  except TypeError:   # not hashable or not weakly referable: not ours
    return None


class _Staged:
  """The function ``jax.jit`` traces: the user's function, planned and
  emitted. One per (function, stream count, options), shared by every
  ``jaxstreams.jit`` of that function, so jax's caches (keyed by this
  object) are shared as ``jax.jit(f)``'s are. It holds the user's function
  weakly: the shared table maps the function to it, and a strong reference
  would keep the function alive forever. The ``jax.jit`` objects handed to
  users hold the function strongly."""

  def __init__(self, fun: Callable, streams: int, auto: bool | None,
               source: str, gpu_lowering: str, shared: bool):
    if shared:
      self._fun_ref = weakref.ref(fun)
    else:   # held by its jit object only: no cycle, hold the function
      self._fun_ref = lambda fun=fun: fun
    self.streams = streams
    self.auto = auto
    self.source = source
    self.gpu_lowering = gpu_lowering
    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
      value = getattr(fun, name, None)
      if isinstance(value, str):
        setattr(self, name, value)
    try:
      self.__signature__ = inspect.signature(fun)
    except (TypeError, ValueError):
      pass

  def __call__(self, *args, **kwargs):
    fun = self._fun_ref()
    if _compat.jit_disabled():
      # Under jax.disable_jit() jax.jit runs the function as plain Python;
      # so do we (stream() blocks are then name scopes that do nothing).
      return fun(*args, **kwargs)
    plan, out_tree, dynamic = make_plan(fun, self.streams, self.auto,
                                        self.source, args, kwargs)
    outs = emit(plan, dynamic, profile=profiling_now(),
                gpu_lowering=self.gpu_lowering)
    return tree_util.tree_unflatten(out_tree, outs)


# function -> {(streams, auto, source, gpu lowering): _Staged}, the function
# held weakly.
_STAGED: "weakref.WeakKeyDictionary[Callable, dict]" = weakref.WeakKeyDictionary()
_STAGED_LOCK = threading.Lock()


def _staged_for(fun: Callable, streams: int, auto: bool | None,
                source: str, gpu_lowering: str) -> _Staged:
  """The shared staged function of ``fun``. Only callables compared by
  identity are shared: an equal but distinct callable (a bound method made
  again) would find the entry of one that may die before it."""
  args = (streams, auto, source, gpu_lowering)
  if type(fun).__eq__ is not object.__eq__:
    return _Staged(fun, *args, shared=False)
  with _STAGED_LOCK:
    try:
      by_key = _STAGED.setdefault(fun, {})
    except TypeError:   # not weakly referable
      return _Staged(fun, *args, shared=False)
    staged = by_key.get(args)
    if staged is None:
      staged = by_key[args] = _Staged(fun, *args, shared=True)
    return staged


class _Spec:
  """What ``jaxstreams.jit`` was given. It makes the ``jax.jit`` functions
  and holds none of them, so nothing here forms a reference cycle with the
  user's function."""

  def __init__(self, fun: Callable, streams: int | None, auto: bool | None,
               jit_kwargs: dict[str, Any], gpu_lowering: str | None = None):
    self.fun = fun
    self.streams = streams
    self.auto = auto
    self.jit_kwargs = jit_kwargs
    self.gpu_lowering = gpu_lowering   # None: the option's, when made
    self.source = ("jaxstreams.jit(streams=...)" if streams is not None
                   else "the jaxstreams_streams option")

  def lowering(self) -> str:
    """The GPU lowering of the ``jax.jit`` functions made from this spec now
    (fixed when ``streams`` was given)."""
    return self.gpu_lowering or config.read("jaxstreams_gpu_lowering")

  def streams_now(self) -> int:
    if self.streams is not None:
      return self.streams
    return config.read("jaxstreams_streams")

  def array_function(self, context: str) -> Callable:
    """The function, for a caller that passes every argument as an array
    (``serve``, ``staged``); a TypeError naming ``context`` when it was
    made with static arguments, which such a caller cannot honour."""
    static = sorted(k for k in ("static_argnums", "static_argnames")
                    if self.jit_kwargs.get(k) not in (None, (), []))
    if static:
      raise TypeError(
          f"{context}: {_function_name(self.fun)} is a jaxstreams.jit "
          f"function with {', '.join(static)}; {context} passes every "
          "argument as an array. Bind static values first "
          "(functools.partial) and pass that.")
    return self.fun

  def jitted(self, streams: int):
    """A new ``jax.jit`` function of the shared staged function. The
    ``jaxstreams_gpu_lowering`` option is read here, when the ``jax.jit``
    function is made: jax's trace cache does not know the option, so a
    function traced one way must not be found by one made the other way."""
    staged = _staged_for(self.fun, streams, self.auto, self.source,
                         self.lowering())
    return jax.jit(staged, **self.jit_kwargs)

  def plan(self, *args, **kwargs) -> StreamPlan:
    """The ``StreamPlan`` for these arguments (traces; does not compile)."""
    streams = self.streams_now()
    plans = []

    @functools.wraps(self.fun)
    def plan_only(*a, **k):
      plans.append(make_plan(self.fun, streams, self.auto, self.source,
                             a, k)[0])

    trace_kwargs = {k: v for k, v in self.jit_kwargs.items()
                    if k in _TRACE_ONLY_PARAMETERS}
    jax.jit(plan_only, **trace_kwargs).trace(*args, **kwargs)
    return dataclasses.replace(report(plans[0]), gpu_lowering=self.lowering())


def make_plan(fun: Callable, streams: int, auto: bool | None, source: str,
              args, kwargs) -> tuple[PartitionedProgram, Any, list]:
  """Trace the user function on the traced arguments and plan it: the
  partitioned program (what ``emit`` lowers), the output tree and the
  traced arguments in flat order.

  Called inside a ``jax.jit`` trace: array arguments are tracers, static
  arguments are the values themselves and stay baked in, as in jax.jit.
  """
  closed, dynamic, out_tree = trace(
      fun, args, kwargs, traced=lambda leaf: isinstance(leaf, jax.core.Tracer))
  plan = _pipeline.plan_program(closed, streams, source, _function_name(fun),
                                _pipeline.options_from_config(auto))
  return plan, out_tree, dynamic


class StreamJit:
  """A ``jaxstreams.jit`` function whose stream count comes from the option."""

  def __init__(self, spec: _Spec):
    self._spec = spec
    self._by_streams: dict[int, Any] = {}
    self._lock = threading.Lock()   # one jax.jit per count, even when racing
    functools.update_wrapper(self, spec.fun)

  def jitted(self, streams: int):
    jitted = self._by_streams.get(streams)
    if jitted is None:
      with self._lock:
        jitted = self._by_streams.get(streams)
        if jitted is None:
          jitted = self._by_streams[streams] = \
              self._spec.jitted(streams)
    return jitted

  def __call__(self, *args, **kwargs):
    streams = config.read("jaxstreams_streams")
    jitted = self._by_streams.get(streams)
    if jitted is None:
      jitted = self.jitted(streams)
    return jitted(*args, **kwargs)

  def _current(self):
    return self.jitted(self._spec.streams_now())

  def plan(self, *args, **kwargs) -> StreamPlan:
    """The ``StreamPlan`` for these arguments (traces; does not compile)."""
    return self._spec.plan(*args, **kwargs)

  def lower(self, *args, **kwargs):
    """Like ``jax.jit(f).lower``: the lowered program, regions included."""
    return self._current().lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    """Like ``jax.jit(f).trace``."""
    return self._current().trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    return self._current().eval_shape(*args, **kwargs)

  def clear_cache(self) -> None:
    for jitted in self._by_streams.values():
      jitted.clear_cache()

  def __get__(self, instance, owner=None):
    if instance is None:
      return self
    return functools.partial(self, instance)

  def __repr__(self) -> str:
    return (f"<jaxstreams.jit {_function_name(self._spec.fun)}, "
            "streams from the jaxstreams_streams option>")


def plan(fun: Callable, *, streams: int | None = None, auto: bool | None = None,
         gpu_lowering: str | None = None,
         **jit_kwargs: Any) -> Callable[..., StreamPlan]:
  """``jaxstreams.plan(f, streams=4)(*args)``: the ``StreamPlan`` of ``f``.

  ``f`` may be a plain function or a ``jaxstreams.jit`` function (then its
  own ``streams`` and ``jax.jit`` keywords are used unless given here).
  """
  spec = spec_of(fun)
  if spec is not None:
    if streams is None and auto is None and gpu_lowering is None and not jit_kwargs:
      return spec.plan
    fun, jit_kwargs = spec.fun, {**spec.jit_kwargs, **jit_kwargs}
    streams = streams if streams is not None else spec.streams
    auto = auto if auto is not None else spec.auto
    gpu_lowering = gpu_lowering or spec.gpu_lowering
  return jit(fun, streams=streams, auto=auto, gpu_lowering=gpu_lowering,
             **jit_kwargs).plan


def _function_name(fun: Callable) -> str:
  return getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None) \
      or repr(fun)
