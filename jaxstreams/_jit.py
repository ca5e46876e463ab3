"""``jaxstreams.jit``: ``jax.jit`` with a stream plan in the middle.

A ``jaxstreams.jit`` function calls ``jax.jit`` functions of a *staged*
function. When ``jax.jit`` traces the staged function (once per set of
shapes, dtypes and static values), it traces the user's function to a jaxpr,
runs the pipeline on it (tag -> assign -> partition) and emits the planned
program (lower). Everything else is ``jax.jit``'s: the cache, static and
donated arguments, shardings, the C++ fast path on later calls, and
transformations applied from outside.

Which ``jax.jit`` function a call reaches is chosen by
``jaxstreams.choose.choice``, from the first top-level call on: on CPU the
program ``jax.jit`` builds; on a GPU the way for top-level calls (compiler
options included, which jax refuses inside another trace; timed in the
first calls where the rule leaves it open) and the way for calls traced
inside another jit. A ``StreamJit`` is a ``functools.partial`` whose
function is what serves calls now: its call goes through ``partial``'s own
C call straight to ``jax.jit``'s C++ fast path where no choice remains; on
a GPU one Python check of the trace state picks top level or nested. A
function that reads its stream count from the option goes straight to the
function for the count in force, until an option changes. This module is
``jax.jit``'s surface: the keywords, ``lower`` / ``trace`` / ``eval_shape``
/ ``plan``; the staged function ``jax.jit`` traces and the shared plans are
``_jit_staged.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import weakref
from typing import Any, Callable

import jax

from jaxstreams import _checks, _compat, _pipeline, config
from jaxstreams._jit_staged import (Plans, make_plan, plans_for,
                                    qualified_name, staged_for)
from jaxstreams.choose import choice, dispatch
from jaxstreams.lower import gpu, memory
from jaxstreams.lower.emit import FUSING_PROGRAMS, emits_inline
from jaxstreams.partition import PartitionedProgram, StreamPlan, report

__all__ = ["jit", "plan", "spec_of", "StreamJit"]

_JIT_PARAMETERS = frozenset(
    name for name, p in inspect.signature(jax.jit).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _check_streams(streams: Any, source: str) -> int:
  return _checks.integer(streams, name="streams", context=source, minimum=1,
                         meaning=" (1 means only the main stream)")


def jit(fun: Callable | None = None, *, streams: int | None = None,
        spread: bool | None = None, gpu_lowering: str | None = None,
        **jit_kwargs: Any):
  """Like ``jax.jit``, with a stream plan of the function's stream blocks.

  Usable as ``@jaxstreams.jit``, ``@jaxstreams.jit(streams=4)`` or
  ``jaxstreams.jit(f, streams=4)``. ``streams`` is the number of stream
  groups (stream ids ``0 .. streams-1``, 0 the main stream); ``None`` reads
  the ``jaxstreams_streams`` option at calls (again after an option
  changes), so an absl flag parsed after decoration counts. Every other
  keyword is ``jax.jit``'s (``static_argnums``, ``donate_argnums``,
  ``in_shardings``, ...). The result has ``.lower``,
  ``.trace``, ``.eval_shape`` and ``.plan`` and gives exactly the results of
  ``jax.jit(fun)`` on CPU. ``spread=True`` lets the cost-model scheduler
  spread what no block placed over the streams, where its estimate says the
  split pays (``None`` reads the ``jaxstreams_spread`` option). Plan options
  are read when the function is traced.

  ``gpu_lowering`` is how a plan of several streams runs on a GPU (see
  ``jaxstreams.lower.gpu``): ``"default"`` (XLA's CONCURRENT CUDA graphs at
  top level, or the fastest way timed at the first call; inside another jit
  what the installed XLA runs side by side), ``"inline"``,
  ``"concurrent"``, ``"streams"`` or ``"streams_concurrent"``. ``None``
  reads the ``jaxstreams_gpu_lowering`` option when the function is made
  (with ``streams=None``: at its first call with each stream count). On
  CPU every way is the program ``jax.jit`` builds.

  As with ``jax.jit``, wrapping the same function again with the same
  options reuses its traces and compiled programs.
  """
  if streams is not None:
    _check_streams(streams, "jaxstreams.jit")
  if spread is not None and not isinstance(spread, bool):
    raise TypeError(f"jaxstreams.jit: spread must be True, False or None "
                    f"(read the jaxstreams_spread option), got {spread!r}")
  if gpu_lowering is not None and gpu_lowering not in gpu.NAMES:
    raise ValueError(f"jaxstreams.jit: gpu_lowering must be one of "
                     f"{', '.join(map(repr, gpu.NAMES))} or None "
                     f"(read the jaxstreams_gpu_lowering option), got "
                     f"{gpu_lowering!r}")
  unknown = sorted(set(jit_kwargs) - _JIT_PARAMETERS)
  if unknown:
    raise TypeError(f"jaxstreams.jit got unexpected keyword argument(s) "
                    f"{', '.join(unknown)}; it takes streams=, spread=, "
                    f"gpu_lowering= and the keywords of jax.jit: "
                    f"{', '.join(sorted(_JIT_PARAMETERS))}")
  if fun is None:
    return lambda f: jit(f, streams=streams, spread=spread,
                         gpu_lowering=gpu_lowering, **jit_kwargs)
  _compat.hide_package_frames()
  # jax.jit's own checks and messages for what it does not take (a
  # non-callable, a generator function, bad static_argnums, ...): the
  # function jax.jit traces later is jaxstreams', which would hide them.
  jax.jit(fun, **jit_kwargs)
  if streams is not None and gpu_lowering is None:
    # Its jax.jit functions are made from now on: its plan must report
    # the way they run.
    gpu_lowering = config.read("jaxstreams_gpu_lowering")
  spec = _Spec(fun, streams, spread, dict(jit_kwargs), gpu_lowering)
  wrapper = StreamJit(spec, streams)
  if streams is None:
    wrapper._for_streams(1)   # let jax.jit check its keywords now
  return wrapper


def spec_of(fun: Any) -> "_Spec | None":
  """What ``jaxstreams.jit`` was given to make ``fun`` (its function,
  ``streams``, ``spread`` and ``jax.jit`` keywords), or None when ``fun`` is
  not a ``jaxstreams.jit`` function. The one way to ask."""
  return fun._spec if isinstance(fun, StreamJit) else None


class _Spec:
  """What ``jaxstreams.jit`` was given. It makes the ``jax.jit`` functions
  and holds none of them, so nothing here forms a reference cycle with the
  user's function."""

  def __init__(self, fun: Callable, streams: int | None, spread: bool | None,
               jit_kwargs: dict[str, Any], gpu_lowering: str | None = None):
    self.fun = fun
    self.streams = streams
    self.spread = spread
    self.jit_kwargs = jit_kwargs
    self.gpu_lowering = gpu_lowering   # None: the option's, when made
    self.source = ("jaxstreams.jit(streams=...)" if streams is not None
                   else "the jaxstreams_streams option")
    self._own_plans: dict[tuple, Plans] = {}   # where fun cannot share
    # jax reads its C++ call cache setting when a jax.jit function is made;
    # these are made later, so they get the one in force now.
    self.cpp_cache = _compat.jit_cpp_cache()

  def plans(self, streams: int) -> Plans:
    """The plans this function's programs at ``streams`` share."""
    return plans_for(self.fun, streams, self.spread, self.source,
                      self._own_plans)

  def lowering(self) -> str:
    """The GPU lowering of the functions made from this spec now (fixed
    when ``streams`` was given)."""
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
          f"{context}: {qualified_name(self.fun)} is a jaxstreams.jit "
          f"function with {', '.join(static)}; {context} passes every "
          "argument as an array. Bind static values first "
          "(functools.partial) and pass that.")
    return self.fun

  def static_arguments(self, args, kwargs) -> tuple[set, set]:
    """The positions and names of the static arguments of a call with
    ``args`` and ``kwargs``: jax.jit's ``static_argnums`` and
    ``static_argnames``, each completed from the other through the
    function's signature, as jax does."""
    nums = self.jit_kwargs.get("static_argnums")
    names = self.jit_kwargs.get("static_argnames")
    if nums is None and names is None:
      return set(), set()
    nums = set((nums,) if isinstance(nums, int) else nums or ())
    names = set((names,) if isinstance(names, str) else names or ())
    nums = {n % len(args) if n < 0 and args else n for n in nums}
    try:
      positional = [p.name
                    for p in inspect.signature(self.fun).parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
      positional = []
    if nums and not self.jit_kwargs.get("static_argnames"):
      names |= {positional[n] for n in nums if n < len(positional)}
    if names and not self.jit_kwargs.get("static_argnums"):
      nums |= {i for i, name in enumerate(positional) if name in names}
    return ({n for n in nums if n < len(args)},
            {k for k in names if k in kwargs})

  def split_static(self, args, kwargs) -> tuple[tuple, tuple]:
    """``((dynamic args, dynamic kwargs), static values)`` of a call: what a
    compiled program takes, and what jax.jit bakes into it."""
    nums, names = self.static_arguments(args, kwargs)
    if not nums and not names:
      return (tuple(args), dict(kwargs)), ()
    dynamic = (tuple(a for i, a in enumerate(args) if i not in nums),
               {k: v for k, v in kwargs.items() if k not in names})
    return dynamic, (tuple(args[i] for i in sorted(nums)),
                     tuple(sorted((k, kwargs[k]) for k in names)))

  def dynamic_arguments(self, args, kwargs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` without the static ones, as a compiled program
    takes them."""
    return self.split_static(args, kwargs)[0]

  def jitted(self, streams: int, program: str,
             compiler_options: dict[str, str] | None = None,
             donate: bool = True):
    """A ``jax.jit`` function of the shared staged function of ``program``
    (``"inline"``, ``"streams"``, or ``"bodies"``: stream calls only in
    shard_map bodies; see ``jaxstreams.lower.emit``), with the way's
    ``compiler_options`` under the user's own."""
    staged = staged_for(self.fun, streams, self.spread, self.source,
                         program, self.plans(streams),
                         strict=self.lowering() != gpu.DEFAULT)
    kwargs = dict(self.jit_kwargs)
    options = {**(compiler_options or {}),
               **(kwargs.get("compiler_options") or {})}
    if options:
      kwargs["compiler_options"] = options
    if not donate:
      kwargs.pop("donate_argnums", None)
      kwargs.pop("donate_argnames", None)
    with _compat.using_jit_cpp_cache(self.cpp_cache):
      return jax.jit(staged, **kwargs)

  def plan(self, *args, **kwargs) -> StreamPlan:
    """The ``StreamPlan`` for these arguments (traces; does not compile)."""
    return report(self.partitioned(*args, **kwargs))

  def partitioned(self, *args, **kwargs) -> PartitionedProgram:
    """The partitioned program for these arguments, what ``emit`` lowers.
    The trace is jax's uncached one: it shares the plan with the calls'
    traces, and jax's accounting sees no jit trace of its own."""
    streams = self.streams_now()
    plans = []

    @functools.wraps(self.fun)
    def plan_only(*a, **k):
      plans.append(make_plan(self.fun, streams, self.spread, self.source,
                             a, k, self.plans(streams))[0])
      return ()

    nums, names = self.static_arguments(args, kwargs)
    _compat.trace_to_jaxpr(plan_only, args, kwargs, sorted(nums), sorted(names))
    return plans[0]


class StreamJit(functools.partial):
  """A ``jaxstreams.jit`` function.

  Calling it calls ``self.func``: until the first top-level call, a
  function that settles which ``jax.jit`` function serves calls
  (``jaxstreams.choose.choice``); then that ``jax.jit`` function itself, or
  on a GPU a two-way switch between the top-level and the nested one (while
  the ways are timed: a lookup by signature). ``functools.partial`` makes
  that call in C: a ``jaxstreams.jit`` call costs what the ``jax.jit`` call
  costs.
  """

  def __new__(cls, spec: _Spec, streams: int | None):
    self = super().__new__(cls, _unset)
    functools.update_wrapper(self, spec.fun)
    self._spec = spec
    self._streams = streams
    self._jits: dict[tuple, Any] = {}
    self._children: dict[int, StreamJit] = {}   # streams=None: one per count
    self._lock = threading.RLock()
    self._chooser = choice.Chooser(self)
    self._devices: int | None = None   # of the call that settled, on a GPU
    # The plan of the call that settled, where a top-level way's compiler
    # options follow it (CONCURRENT graphs take convolutions in).
    self._settled_plan: StreamPlan | None = None
    self._point_to(dispatch.FirstCall(weakref.ref(self)))
    return self

  def _point_to(self, target: Callable) -> None:
    self.__setstate__((target, (), None, self.__dict__))

  # -- which jax.jit function ------------------------------------------------

  def _for_streams(self, streams: int) -> "StreamJit":
    """streams=None: the function for the option's current count."""
    child = self._children.get(streams)
    if child is None:
      with self._lock:
        child = self._children.get(streams)
        if child is None:
          child = StreamJit(_Spec(self._spec.fun, streams, self._spec.spread,
                                  self._spec.jit_kwargs,
                                  self._spec.lowering()), streams)
          child._spec.source = self._spec.source
          child._spec.cpp_cache = self._spec.cpp_cache
          self._children[streams] = child
    return child

  def _by_option(self) -> "StreamJit":
    """streams=None: the function for the option's count now. While that
    count holds (``config.on_change`` says when it may not), calls go
    straight to it, so reading the option costs a call nothing."""
    with _BY_OPTION_LOCK:
      child = self._for_streams(config.read("jaxstreams_streams"))
      self._point_to(child)
      _BY_OPTION.add(self)
    return child

  def _jit(self, way: gpu.Way, *, top_level: bool, donate: bool = True,
           plan: StreamPlan | None = None):
    """The ``jax.jit`` function of ``way`` (top level: with its compiler
    options for ``plan``, by default the settling call's; inside another
    trace: its nested program)."""
    options = (way.compiler_options(self._streams, plan or self._settled_plan)
               if top_level else {})
    program = self._program(way, top_level)
    key = (program, tuple(sorted(options.items())), donate)
    jitted = self._jits.get(key)
    if jitted is None:
      with self._lock:
        jitted = self._jits.get(key)
        if jitted is None:
          jitted = self._jits[key] = self._spec.jitted(
              self._streams, program, options, donate)
    return jitted

  def _program(self, way: gpu.Way, top_level: bool) -> str:
    """What ``emit`` builds for ``way`` at top level or inside another
    trace (see ``jaxstreams.lower.emit``)."""
    program = way.program if top_level else way.nested.program
    if program in FUSING_PROGRAMS and self._spans_devices(top_level):
      program = "bodies"
    return program

  def _spans_devices(self, top_level: bool) -> bool:
    """Whether the program may be partitioned over several devices: then
    XLA's partitioner may put collectives into region calls, which XLA:GPU
    cannot compile, so only fully manual shard_map bodies get calls (the
    "bodies" program). Top level: the devices of the settling call's
    arguments; inside another jit, whose devices nobody here knows: whether
    this process has several GPUs (XLA:CPU runs stream calls in place)."""
    if top_level and self._devices is not None:
      return self._devices > 1
    devices = jax.devices()
    return len(devices) > 1 and gpu.is_gpu(devices[0].platform)

  def _nested_way(self) -> gpu.Way:
    name = self._spec.lowering()
    return (gpu.default_nested() if name == gpu.DEFAULT
            else gpu.WAYS[name].nested)

  def _nested_jit(self):
    """The ``jax.jit`` function of calls traced inside another jit: the
    nested way's (what a GPU runs there; on CPU the same results), so an
    outer jit lowered for a GPU from a machine without one gets the GPU's
    program."""
    return self._jit(self._nested_way(), top_level=False)

  def _nested_jit_for(self, args, kwargs):
    """The ``jax.jit`` function of this call traced inside another jit:
    ``_nested_jit``'s, or ``jax.jit``'s program where the nested way emits
    exactly that for this signature's plan (nothing off the main stream,
    no loops to run as one) and the way is the default. Then the call
    shares its trace with the top-level calls, whose way builds that
    program too, as ``jax.jit``'s calls share one trace in every context.
    A way asked for runs its nested program in both contexts on CPU (one
    trace too); a nested way that emits something else than the top-level
    one is another program, and another trace. The default also runs
    ``jax.jit``'s program where the nested way may not fit in the device's
    memory (``jaxstreams.lower.memory.nested_check``)."""
    way = self._nested_way()
    program = self._program(way, top_level=False)
    if (program != "inline" and self._spec.lowering() == gpu.DEFAULT
        and self._nested_runs_inline(program, args, kwargs)):
      way = gpu.WAYS["inline"]
    return self._jit(way, top_level=False)

  def _nested_runs_inline(self, program: str, args, kwargs) -> bool:
    """Whether ``program`` emits ``jax.jit``'s program for the plan of
    these arguments, or may not fit (a bound of what it adds against the
    device's free memory, the copies ``jax.vmap`` runs counted). Kept per
    signature: a function called inside a traced loop body or under an
    eager ``jax.grad`` asks at every call."""
    spec = self._spec
    plans = spec.plans(self._streams)
    copies = memory.vmapped_copies(jax.tree_util.tree_leaves((args, kwargs)))
    key = plans.key(args, kwargs, (
        program, _pipeline.options_from_config(spec.spread), copies))
    known = plans.facts.get(key) if key is not None else None
    if known is None:
      partitioned = spec.partitioned(*args, **kwargs)
      known = emits_inline(partitioned, program) or not memory.nested_check(
          partitioned, program, memory.default_device(), copies).fits
      if key is not None:
        if len(plans.facts) >= 4 * plans.SIZE:   # as bounded as the plans
          plans.facts.clear()
        plans.facts[key] = known
    return known

  def _aot_jit(self, args, kwargs):
    """The ``jax.jit`` function that ``lower``, ``trace`` and
    ``eval_shape`` use: the one a top-level call on a GPU runs, compiler
    options included. Its program is the CPU calls' program (the options
    are all that differ, and XLA:CPU ignores them), so one answer serves
    every platform, including lowering for a GPU from a machine without
    one; and both trace the same staged function, so jax's trace and
    lowering caches serve both."""
    chosen = self._chooser.choice_for(args, kwargs)
    if not self._chooser.settled:
      self._devices = choice.device_count(args, kwargs, self._spec.jit_kwargs)
    return self._jit(chosen.way, top_level=True,
                     plan=self.options_plan(chosen.way, args, kwargs))

  def options_plan(self, way: gpu.Way, args, kwargs) -> StreamPlan | None:
    """The plan a top-level way's compiler options follow (only ways with
    CONCURRENT graphs read it: a plan whose regions hold convolutions gets
    them into the graphs), for a call with these arguments."""
    return self._spec.plan(*args, **kwargs) if way.concurrent else None

  # -- jax.jit's interface -----------------------------------------------------

  def lower(self, *args, **kwargs):
    """Like ``jax.jit(f).lower``: the program a top-level call on a GPU
    runs, compiler options included."""
    if self._streams is None:
      return self._for_streams(self._spec.streams_now()).lower(*args, **kwargs)
    return self._aot_jit(args, kwargs).lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    """Like ``jax.jit(f).trace``."""
    if self._streams is None:
      return self._for_streams(self._spec.streams_now()).trace(*args, **kwargs)
    return self._aot_jit(args, kwargs).trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    if self._streams is None:
      return self._for_streams(self._spec.streams_now()).eval_shape(
          *args, **kwargs)
    return self._aot_jit(args, kwargs).eval_shape(*args, **kwargs)

  def plan(self, *args, target: Any = None, **kwargs) -> StreamPlan:
    """The ``StreamPlan`` for these arguments (traces; does not compile),
    with how a GPU runs it. With ``target`` ("h100", "h200", a
    ``GpuTarget``, a GpuTargetConfigProto file, or "local": this machine's
    GPU), every way is also compiled for that GPU, in a child process, and
    the plan states what each needs on the device against ``jax.jit``'s
    program (``plan.memory``; ``jaxstreams.xla.ways``). A function with a
    parameter named ``target`` gets it: use ``jaxstreams.plan(f,
    target=...)(*args)`` there."""
    if target is not None and _takes_keyword(self._spec.fun, "target"):
      kwargs["target"], target = target, None
    return self._plan(args, kwargs, target)

  def _plan(self, args, kwargs, target: Any = None) -> StreamPlan:
    if self._streams is None:
      return self._for_streams(self._spec.streams_now())._plan(
          args, kwargs, target)
    found = self._spec.plan(*args, **kwargs)
    report = self._chooser.report(found, args, kwargs)
    devices = choice.device_count(args, kwargs, self._spec.jit_kwargs)
    if devices > 1 and not found.is_single_stream:
      report["gpu_reason"] += (
          f"; over {devices} devices, stream calls only inside shard_map "
          "bodies over all their mesh's axes, other regions in place (XLA's "
          "partitioner may put collectives into a region, and XLA:GPU "
          "compiles none inside a stream call)")
    if target is not None and not found.is_single_stream:
      from jaxstreams.xla import ways
      report["memory"] = ways.state_ways(
          self, dataclasses.replace(found, **report), args, kwargs, target)
    return dataclasses.replace(found, **report)

  def clear_cache(self) -> None:
    for jitted in list(self._jits.values()):
      jitted.clear_cache()
    for child in list(self._children.values()):
      child.clear_cache()

  def __get__(self, instance, owner=None):
    if instance is None:
      return self
    return functools.partial(self, instance)

  def __repr__(self) -> str:
    """``jax.jit``'s: the function as ``jax.jit(f)`` shows it (``spec_of``
    and ``plan`` tell a ``jaxstreams.jit`` function apart). Like jax's, it
    never fails."""
    try:
      return f"<PjitFunction of {self.__wrapped__!r}>"
    except Exception:  # noqa: BLE001
      return "<PjitFunction>"

  def __getstate__(self) -> dict:
    """The state ``jax.jit``'s functions give (their function's name,
    static arguments, ...): that of the ``jax.jit`` function top-level calls
    reach now. Like those, a ``jaxstreams.jit`` function cannot be
    pickled."""
    return self._current_jit().__getstate__()

  def _cache_size(self) -> int:
    """The entries in the C++ call caches of this function's ``jax.jit``
    functions (``jax.jit``'s own ``_cache_size``)."""
    return (sum(jitted._cache_size() for jitted in list(self._jits.values()))
            + sum(child._cache_size()
                  for child in list(self._children.values())))

  def _current_jit(self):
    """The ``jax.jit`` function a top-level call reaches now (before the
    first call, the nested one: the same function name and static
    arguments)."""
    if self._streams is None:
      return self._for_streams(self._spec.streams_now())._current_jit()
    target = getattr(self.func, "top", self.func)
    return (self._nested_jit()
            if isinstance(target, (dispatch.FirstCall, dispatch.BySignature))
            else target)

  def __reduce__(self):
    raise TypeError(f"cannot pickle {self!r} (jax.jit functions cannot be "
                    "pickled either)")


# The streams=None functions whose calls go straight to their option's count:
# any change of the options sends them back to reading it.
_BY_OPTION: "weakref.WeakSet[StreamJit]" = weakref.WeakSet()
_BY_OPTION_LOCK = threading.RLock()


def _option_changed() -> None:
  with _BY_OPTION_LOCK:
    for fn in list(_BY_OPTION):
      fn._point_to(dispatch.FirstCall(weakref.ref(fn)))
    _BY_OPTION.clear()


config.on_change(_option_changed)


def _unset(*args, **kwargs):
  raise AssertionError("a jaxstreams.jit function called while being made")


def plan(fun: Callable, *, streams: int | None = None,
         spread: bool | None = None, gpu_lowering: str | None = None,
         target: Any = None, **jit_kwargs: Any) -> Callable[..., StreamPlan]:
  """``jaxstreams.plan(f, streams=4)(*args)``: the ``StreamPlan`` of ``f``.

  ``f`` may be a plain function or a ``jaxstreams.jit`` function (then its
  own ``streams`` and ``jax.jit`` keywords are used unless given here).
  ``target``: every way also compiled for that GPU, and what each needs on
  the device stated (see ``StreamJit.plan``).
  """
  spec = spec_of(fun)
  if spec is None or (streams is not None or spread is not None
                      or gpu_lowering is not None or jit_kwargs):
    if spec is not None:
      fun, jit_kwargs = spec.fun, {**spec.jit_kwargs, **jit_kwargs}
      streams = streams if streams is not None else spec.streams
      spread = spread if spread is not None else spec.spread
      gpu_lowering = gpu_lowering or spec.gpu_lowering
    fun = jit(fun, streams=streams, spread=spread, gpu_lowering=gpu_lowering,
              **jit_kwargs)
  return lambda *args, **kwargs: fun._plan(args, kwargs, target)


def _takes_keyword(fun: Callable, name: str) -> bool:
  """Whether ``fun`` takes a keyword argument ``name`` (a parameter of
  that name, or ``**kwargs``); False where Python cannot tell."""
  try:
    parameters = inspect.signature(fun).parameters.values()
  except (TypeError, ValueError):
    return False
  return any((p.name == name and p.kind is not p.POSITIONAL_ONLY)
             or p.kind is p.VAR_KEYWORD for p in parameters)
