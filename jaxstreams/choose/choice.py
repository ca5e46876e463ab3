"""Which way a ``jaxstreams.jit`` function's top-level calls run on a GPU.

``jaxstreams.lower.gpu`` holds the ways and the static rule; this module
applies it to a function and, where the rule leaves it open, times the
candidate ways in the function's own calls (one signature's choice:
``signature``; the timing rule and the decisions on disk: ``timing``; the
background compiles: ``compile_pool``; what the function calls meanwhile:
``dispatch``). On CPU every call runs the program ``jax.jit`` builds and
nothing here is timed.

The first call costs what ``jax.jit``'s does:

* The first top-level call of a signature (argument shapes, dtypes and
  static values) compiles ``jax.jit``'s program (``inline``) in the
  caller's thread and returns its result as soon as it ran, as ``jax.jit``
  would. The other candidates (``gpu.candidates(plan)``, never a way it
  left out) are lowered in the caller's thread (jax's trace context is the
  thread's) and compiled beside it in a few background threads, at most
  one per core but one, at the lowest CPU priority (Linux): they take only
  the CPU the caller's own compile leaves.
* The calls after it run ``inline`` until every candidate is compiled;
  then each candidate runs once on copies of that call's arguments (a
  warm-up, and proof that it runs: one that fails or would not fit in the
  device's free memory is reported and never runs a call), and the next
  calls are timed, each on one way, in interleaved rounds, as XLA's own
  autotuner times kernels. A timed call waits for its result. A call is
  never split between ways, and each compile is jax's own: the chosen way
  serves later calls from the program compiled in the background.
* ``inline`` is kept unless another way beats it by ``timing.MIN_GAIN`` in the
  median and in most rounds: the default is never slower than ``jax.jit``
  beyond noise. Then the function switches, once, to the chosen way's
  ``jax.jit`` function (its C++ fast path, as before).
* The decision is kept per signature: in this process, and on disk keyed
  by the program (its StableHLO), the device kind, the candidates and the
  jax and jaxlib versions, read before anything is compiled. A returning
  user's first call compiles the kept way only.
* A signature first seen after the function switched runs the chosen way
  at its first call (jax.jit compiles it, as it would compile ``inline``);
  the function notices the new entry in that way's call cache and times
  the ways for it the same way. Functions whose signatures chose different
  ways look their signature up in Python at each call.
* Nothing is timed, and nothing beyond one program compiled, where nothing
  can differ: a plan on one stream, a plan with no two regions on
  different streams that can run side by side (every way runs one chain),
  a single candidate, or a program with side effects (a warm-up would
  repeat them). A failure anywhere in choosing keeps the way that already
  ran and never fails a call. ``jaxstreams_autotune`` off: the static
  default, untimed.
* Where nothing times the ways (no GPU in this process, or
  ``jaxstreams_autotune`` off) but there is a GPU to estimate for (the
  target the arguments are placed on, by default), the structural way
  stands unless its memory vetoes it or another way is estimated faster
  by more than the estimate's held-out error; the estimate of a kind of
  program no GPU run measured does not decide (``estimated``).

Memory is never fatal (``jaxstreams.lower.memory``): a candidate whose
compiled program would not fit in the device's free memory is never run,
and the timing rule asks a way that needs more memory than ``jax.jit``'s
program for a larger gain (``timing.required_gain``). Untimed (autotuning
off, a static argument that cannot be hashed, a program with side
effects), the default's own compile is read at the first call and
``jax.jit``'s program runs where it would not fit. Inside another jit
nothing is compiled: a bound of what the nested way adds, read from the
jaxpr, must fit in a share of the device's free memory
(``StreamJit._nested_runs_inline``).

``str(plan)`` (``plan.gpu_reason``) says which way a signature's calls run,
and when and how it was chosen; ``plan.memory`` what each way needed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Hashable, Sequence

import jax
from jax import tree_util

from jaxstreams import config
from jaxstreams.choose import estimated, timing
from jaxstreams.choose.dispatch import (BySignature, FirstCall, Nested, Switch,
                                        Watch)
from jaxstreams.choose.signature import SignatureChoice
from jaxstreams.lower import gpu, memory
from jaxstreams.lower.emit import emits_inline

if TYPE_CHECKING:
  from jaxstreams.partition import StreamPlan

ONE_STREAM = "one stream: the program jax.jit builds"


# ---------------------------------------------------------------------------
# Where a call runs.

def _shardings(args, kwargs, shardings):
  """The sharding of each argument leaf with one (a placed array, a
  ShapeDtypeStruct on a compile target) and each of ``shardings``, in
  order."""
  for leaf in tree_util.tree_leaves((args, kwargs, shardings)):
    sharding = (leaf if isinstance(leaf, jax.sharding.Sharding)
                else getattr(leaf, "sharding", None))
    if isinstance(sharding, jax.sharding.Sharding):
      yield sharding


def first_device(args, kwargs, jit_kwargs=None):
  """The device of the first argument with a sharding on devices (or of
  ``in_shardings``), else jax's default device: where a call with these
  arguments runs. A sharding over an abstract mesh names no device."""
  shardings = (jit_kwargs or {}).get("in_shardings")
  for sharding in _shardings(args, kwargs, shardings):
    try:
      devices = sharding.device_set
    except ValueError:   # an abstract mesh
      continue
    if devices:
      return next(iter(devices))
  return jax.devices()[0]


def device_count(args, kwargs, jit_kwargs=None) -> int:
  """How many devices a call with these arguments spans: the most any
  argument's sharding (or ``in_shardings``/``out_shardings``) names."""
  shardings = [(jit_kwargs or {}).get(k) for k in ("in_shardings",
                                                    "out_shardings")]
  return max((s.num_devices for s in _shardings(args, kwargs, shardings)),
             default=1)


def platform(args, kwargs, jit_kwargs) -> str:
  """The platform a call with these arguments runs on (a function, so tests
  can pretend)."""
  return first_device(args, kwargs, jit_kwargs).platform


# ---------------------------------------------------------------------------
# The static choice.

@dataclasses.dataclass(frozen=True)
class Choice:
  """How top-level calls run on a GPU, and why."""
  way: gpu.Way
  reason: str
  decision: "timing.Decision | None" = None
  single_stream: bool = False   # nothing off the main stream: one program
  timable: bool = False         # the ways are timed, per signature


def regions_can_overlap(plan: "StreamPlan") -> bool:
  """Whether two regions on different streams have no path between them
  (in the plan or in a shard_map body's plan): only then can a way run
  something side by side that another runs in sequence."""
  reach = [0] * len(plan.regions)    # bit j of reach[i]: a path i -> j
  for a, b in sorted(plan.edges, reverse=True):   # regions are topological
    reach[a] |= (1 << b) | reach[b]
  for i, ri in enumerate(plan.regions):
    for j in range(i + 1, len(plan.regions)):
      if (ri.stream != plan.regions[j].stream
          and not (reach[i] >> j) & 1):
        return True
  return any(regions_can_overlap(body) for body in plan.bodies.values())


def default_way(ways: Sequence[gpu.Way], plan: "StreamPlan") -> gpu.Way:
  """The top-level default for ``plan`` where nothing is timed, if it is a
  candidate for it (the candidates leave out what XLA cannot compile for
  it); else ``jax.jit``'s program."""
  default = gpu.default_top_level(plan)
  return default if default in ways else gpu.WAYS["inline"]


def static_choice(lowering: str, plan: Callable[[], "StreamPlan"],
                  estimate: Callable | None = None) -> Choice:
  """The way top-level calls run on a GPU before anything was timed: the way
  asked for, ``jax.jit``'s program for a plan on one stream or with nothing
  to time, else the top-level default (timed where ``timable``). ``plan()``
  gives the plan, made only if needed. ``estimate(ways, default)``, where
  nothing will time them and there is a GPU to estimate for
  (``Chooser.estimator``): the way estimated fastest among those it
  weighs, and why, or None where it weighs nothing
  (``jaxstreams.choose.estimated``; ``EstimateFailed`` where none could be
  estimated)."""
  if lowering != gpu.DEFAULT:
    return Choice(gpu.WAYS[lowering], f"gpu_lowering={lowering!r}")
  found = plan()
  if found.is_single_stream:
    return Choice(gpu.WAYS["inline"], ONE_STREAM, single_stream=True)
  ways = gpu.candidates(found)
  failed = ""
  if estimate is not None and len(ways) > 1 and regions_can_overlap(found):
    try:
      chosen = estimate(ways, default_way(ways, found))
      if chosen is not None:
        return Choice(gpu.WAYS[chosen[0]], chosen[1])
    except estimated.EstimateFailed as error:
      failed = f"; {error}"
  if not config.read("jaxstreams_autotune"):
    way = default_way(ways, found)
    why = f"the top-level default (jaxstreams_autotune is off{failed})"
    if way.name == "inline":
      why += ("; CONCURRENT graphs would hold nothing side by side here (what "
              "can run side by side is loops, which XLA runs outside its "
              "graphs) and would cost memory")
    return Choice(way, why)
  if len(ways) < 2:
    return Choice(gpu.WAYS["inline"], "nothing to time: the only candidate "
                  "way on this jax")
  if not regions_can_overlap(found):
    return Choice(gpu.WAYS["inline"], "nothing to time: no two regions on "
                  "different streams can run side by side, so every way "
                  "runs one chain")
  names = ", ".join(w.name for w in ways)
  return Choice(default_way(ways, found), "the top-level default; on a GPU the "
                "first call runs jax.jit's program while the other "
                f"candidates compile beside it, and the calls after it time "
                f"{names} and keep the fastest{failed}", timable=True)


def _overflow(owner, way: gpu.Way, args, kwargs) -> str | None:
  """``memory.overflow`` of ``way``'s top-level program for these
  arguments (compiled only where the device says what is free; the call
  compiles it anyway, and jax keeps it)."""
  return None if way.name == "inline" else memory.overflow(
      way.name, lambda: owner._jit(way, top_level=True).trace(
          *args, **kwargs).lower().compile(),
      first_device(args, kwargs, owner._spec.jit_kwargs))


def _leaf_key(leaf) -> Hashable:
  shape = getattr(leaf, "shape", None)
  if shape is None:
    return type(leaf)
  return (tuple(shape), getattr(leaf, "dtype", None),
          bool(getattr(leaf, "weak_type", False)))


# ---------------------------------------------------------------------------
# One function's choices, and what its calls reach.

class Chooser:
  """The choices of one ``jaxstreams.jit`` function at one stream count
  (``owner``, held weakly: the owner holds this). It settles the first
  top-level call, then keeps one choice per signature where the ways are
  timed, and points the owner's calls at what serves them."""

  def __init__(self, owner):
    self._owner = weakref.ref(owner)
    self._lock = threading.RLock()
    self.static: Choice | None = None      # set by the first top-level call
    self._signatures: dict[Hashable, SignatureChoice] = {}
    self._estimated: dict[Hashable, object] = {}   # (way, why) or a failure

  @property
  def settled(self) -> bool:
    return self.static is not None

  def settle(self, args, kwargs) -> Callable:
    """At the first top-level call: choose, point the owner's calls at what
    serves them, and return the ``jax.jit`` function for this call."""
    owner = self._owner()
    with self._lock:
      if not isinstance(owner.func, FirstCall):   # settled by another thread
        return owner.func
      spec = owner._spec
      if not gpu.is_gpu(platform(args, kwargs, spec.jit_kwargs)):
        # One stream: the program of the way asked for (stream calls lower
        # in place), without the GPU's compiler options, for every call,
        # at top level or inside another trace.
        name = spec.lowering()
        target = owner._jit(gpu.WAYS["inline" if name == gpu.DEFAULT else name],
                            top_level=False)
        owner._point_to(target)
        return target
      owner._devices = device_count(args, kwargs, spec.jit_kwargs)
      plans = []

      def plan():
        if not plans:
          plans.append(spec.plan(*args, **kwargs))
        return plans[0]

      choice = static_choice(spec.lowering(), plan,
                             self.estimator(args, kwargs))
      if choice.timable or choice.way.concurrent:
        # CONCURRENT graphs take convolutions in where the plan has them.
        owner._settled_plan = plan()
      if choice.timable:
        key = self.key(args, kwargs)
        if key is not None:
          way = self._start(owner, key, args, kwargs, plan(), running=None)
          self.static = choice
          self.refresh()
          return owner._jit(way, top_level=True)
        choice = Choice(choice.way, "not timed: a static argument cannot be "
                        "hashed")
      if (not choice.single_stream and choice.way.name != "inline"
          and spec.lowering() == gpu.DEFAULT):
        choice = self._fitting(owner, choice, args, kwargs)
      self.static = choice
      top = owner._jit(choice.way, top_level=True)
      nested = top if choice.single_stream else Nested(self._owner)
      owner._point_to(top if top is nested else Switch(top, nested))
      return top

  def estimator(self, args, kwargs) -> Callable | None:
    """``estimated.estimator`` for a call with these arguments: where
    nothing will time the ways and there is a GPU to estimate for, what
    chooses the way by its estimated step (once per signature)."""
    owner = self._owner()
    return estimated.estimator(
        owner, self.key(args, kwargs), args, kwargs,
        first_device(args, kwargs, owner._spec.jit_kwargs), self._estimated)

  def _fitting(self, owner, choice: Choice, args, kwargs) -> Choice:
    """``choice``, the untimed default, where its program fits in the
    device's free memory; else ``jax.jit``'s program (``_overflow``)."""
    overflow = _overflow(owner, choice.way, args, kwargs)
    if overflow is None:
      return choice
    return Choice(gpu.WAYS["inline"], f"{choice.reason}; {overflow}")

  def key(self, args, kwargs) -> Hashable | None:
    """The signature of a call: argument tree, shapes, dtypes and weak
    types, and static values (None where one cannot be hashed)."""
    spec = self._owner()._spec
    dynamic, statics = spec.split_static(args, kwargs)
    leaves, tree = tree_util.tree_flatten(dynamic)
    key = (tree, tuple(map(_leaf_key, leaves)), statics)
    try:
      hash(key)
    except TypeError:
      return None
    return key

  def _start(self, owner, key, args, kwargs, plan: "StreamPlan",
             running: gpu.Way | None) -> gpu.Way:
    """(Holding the lock.) A signature seen for the first time: read its
    decision from disk, else compile its candidates beside this call.
    Returns the way this call runs; ``running`` is the way a call of it
    already ran (None: none did)."""
    started = time.perf_counter()
    ways = gpu.candidates(plan)
    inline = gpu.WAYS["inline"]
    traced = owner._jit(inline, top_level=True).trace(*args, **kwargs)
    if traced.jaxpr.effects:
      way = running or default_way(ways, plan)
      why = ("not timed: the program has side effects, which a warm-up "
             "would repeat")
      overflow = None if running else _overflow(owner, way, args, kwargs)
      if overflow:
        way, why = inline, f"{why}; {overflow}"
      entry = self._signatures[key] = SignatureChoice(way, ways, None, None,
                                                      started)
      entry.decision = timing.Decision(way.name, why)
      return way
    lowered = traced.lower()
    device = first_device(args, kwargs, owner._spec.jit_kwargs)
    disk_key = timing.cache_key(lowered.as_text(), device.device_kind,
                         owner._streams, [w.name for w in ways])
    entry = SignatureChoice(running or inline, ways, disk_key, device, started)
    self._signatures[key] = entry
    cached = timing.load(disk_key)
    if cached is not None and memory.too_big(
        {t.way: t.memory_bytes for t in cached.trials if t.way == cached.way},
        memory.free_bytes(device)):
      cached = None   # chosen where more memory was free: choose again
    if cached is not None and cached.way in {w.name for w in ways}:
      if running is None or cached.way == running.name:
        entry.decision = cached
        return gpu.WAYS[cached.way]
      entry.preset = cached
      entry.compile_beside(owner, [gpu.WAYS[cached.way]], args, kwargs, lowered)
      return running
    entry.compile_beside(owner, [w for w in ways if w != entry.running],
                         args, kwargs, lowered)
    return entry.running

  def call(self, args, kwargs):
    """A top-level call while some signature's choice is open or the
    signatures chose different ways."""
    owner = self._owner()
    key = self.key(args, kwargs)
    entry = self._signatures.get(key)
    if entry is None:
      with self._lock:
        entry = self._signatures.get(key)
        if entry is None:
          way = self.static.way
          if key is not None:
            way = self._start(owner, key, args, kwargs,
                              owner._spec.plan(*args, **kwargs), running=None)
            self.refresh()
      if entry is None:   # this signature's first call, outside the lock
        return owner._jit(way, top_level=True)(*args, **kwargs)
    return entry.call(self, owner, args, kwargs)

  def saw(self, args, kwargs, ran: gpu.Way) -> None:
    """A call that ran ``ran`` had a signature its ``jax.jit`` function had
    not seen: time the ways for it, if this is new."""
    try:
      key = self.key(args, kwargs)
      if key is None or key in self._signatures:
        return
      owner = self._owner()
      with self._lock:
        if key not in self._signatures:
          self._start(owner, key, args, kwargs,
                      owner._spec.plan(*args, **kwargs), running=ran)
          self.refresh()
    except Exception:  # noqa: BLE001 - choosing never fails a call
      pass

  def refresh(self) -> None:
    """Point the owner's top-level calls at the one way every signature
    chose, watching for new signatures; else at the lookup by signature."""
    owner = self._owner()
    if owner is None:
      return
    with self._lock:
      ways = {s.decision.way if s.decision else None
              for s in self._signatures.values()}
      if len(ways) == 1 and None not in ways:
        way = gpu.WAYS[ways.pop()]
        top = owner._jit(way, top_level=True)
        if not (isinstance(owner.func, Watch) and owner.func.top is top):
          owner._point_to(Watch(top, Nested(self._owner), self, way))
      elif not isinstance(owner.func, BySignature):
        owner._point_to(BySignature(self._owner))

  def choice_for(self, args, kwargs, plan=None) -> Choice:
    """How top-level calls with these arguments run now, and why (before
    the first call: the static choice). ``plan``: their plan, if made."""
    owner = self._owner()
    static = self.static or static_choice(
        owner._spec.lowering(),
        lambda: plan or owner._spec.plan(*args, **kwargs),
        self.estimator(args, kwargs))
    if not static.timable:
      return static
    entry = self._signatures.get(self.key(args, kwargs))
    if entry is None:
      return static
    decision = entry.decision
    if decision is None:
      return Choice(entry.running, "being timed: " + entry.status(),
                    timable=True)
    how = ("chosen at an earlier run, kept on disk" if decision.cached else
           "chosen in this signature's calls" if decision.timing else
           "chosen at this signature's first call")
    return Choice(gpu.WAYS[decision.way], how, decision, timable=True)

  def report(self, plan: "StreamPlan", args, kwargs) -> dict[str, str]:
    """The plan's ``gpu_lowering`` and ``gpu_reason`` for these arguments:
    the way top-level calls run, how and when it was chosen, and the way
    of calls traced inside another jit."""
    if plan.is_single_stream:
      return {"gpu_lowering": "inline", "gpu_reason": ONE_STREAM}
    owner = self._owner()
    choice = self.choice_for(args, kwargs, plan)
    why = choice.reason
    if choice.decision is not None:
      why += ": " + choice.decision.describe()
    if owner._spec.lowering() == gpu.DEFAULT:
      partitioned = owner._spec.partitioned(*args, **kwargs)
      nested_why = gpu.why_default_nested(plan)
      program = owner._program(owner._nested_way(), top_level=False)
      if not emits_inline(partitioned, program):
        nested_why += "; " + memory.nested_check(
            partitioned, program, memory.default_device()).describe()
    else:
      nested_why = (f"inside another jit: {owner._nested_way().name!r} (no "
                    "compiler options reach a function traced there)")
    found = {"gpu_lowering": choice.way.name,
             "gpu_reason": f"{choice.way.summary} ({why}); {nested_why}"}
    if choice.decision is not None:
      entry = self._signatures.get(self.key(args, kwargs))
      measured = memory.measured(choice.decision, entry.footprints
                                 if entry is not None else {})
      if measured is not None:
        found["memory"] = measured
    return found

  def deciding(self, args, kwargs) -> bool:
    """Whether the way for these arguments is being chosen now (their
    signature's candidates compiling or being timed)."""
    entry = self._signatures.get(self.key(args, kwargs))
    return entry is not None and entry.decision is None

  def wait_compiled(self, args, kwargs) -> dict[str, float]:
    """Wait for this signature's background compiles; the seconds each
    took (failed ones left out). For benchmarks and tests."""
    entry = self._signatures.get(self.key(args, kwargs))
    if entry is None:
      return {}
    pending = dict(entry.pending)
    concurrent.futures.wait(list(pending.values()))
    seconds = dict(entry.compile_seconds)
    seconds.update({w: f.result()[1] for w, f in pending.items()
                    if not f.cancelled() and f.exception() is None})
    return seconds
