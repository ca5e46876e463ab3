"""One signature's choice of way: its candidate ways compiled in the
background, each run once (a warm-up), timed in interleaved rounds of the
signature's calls, and decided (``timing``'s rule, kept on disk).

``jaxstreams.choose.choice`` keeps one ``SignatureChoice`` per signature of a
function and hands each call to it while the choice is open; ``chooser``
below is that ``Chooser`` (``refresh`` points the function's calls at what
serves them once a choice is made), and ``owner`` the ``jaxstreams.jit``
function (``_jit(way, top_level=True)`` gives a way's ``jax.jit``
function). Choosing never fails a call: a failure keeps the way that runs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time
from typing import Any, Sequence

import jax
from jax import tree_util

from jaxstreams.choose import compile_pool, timing
from jaxstreams.lower import gpu, memory


def _copies(dynamic):
  """Copies of the dynamic arguments: a warm-up never reads, let alone
  consumes, the caller's arrays."""
  copy = lambda x: x.copy() if isinstance(x, jax.Array) else x
  return tree_util.tree_map(copy, dynamic)


def _any_deleted(args, kwargs) -> bool:
  return any(isinstance(x, jax.Array) and x.is_deleted()
             for x in tree_util.tree_leaves((args, kwargs)))


class SignatureChoice:
  """The choice for one signature of one function: its candidates compiling
  in the background, then timed in its calls, then decided. ``running`` is
  the way that serves its calls until then (``inline`` after a first call;
  the function's way where the signature came after it switched)."""

  def __init__(self, running: gpu.Way, ways: Sequence[gpu.Way],
               disk_key: str | None, device, started: float):
    self.running = running
    self.ways = tuple(ways)
    self.disk_key = disk_key
    self.device = device
    self.started = started
    self.decision: timing.Decision | None = None
    self.preset: timing.Decision | None = None   # from disk, its way compiling
    self.pending: dict[str, concurrent.futures.Future] = {}
    self.compile_seconds: dict[str, float] = {}
    self.failed: dict[str, str] = {}
    self.memory: dict[str, int | None] = {}
    self.footprints: dict[str, memory.Footprint | None] = {}
    self.compiled: dict[str, Any] = {}
    self.rounds: timing.Rounds | None = None
    self.calls = 1      # of this signature, its first included
    self._served = None   # the decided way's jax.jit function
    self._lock = threading.Lock()

  def compile_beside(self, owner, ways: Sequence[gpu.Way], args, kwargs,
                     lowered_inline) -> None:
    """Lower ``ways`` here (jax's trace context is this thread's) and
    compile them in the pool."""
    for way in ways:
      try:
        lowered = (lowered_inline if way.name == "inline" else
                   owner._jit(way, top_level=True)
                   .trace(*args, **kwargs).lower())
      except Exception as error:  # noqa: BLE001 - a way that cannot lower
        self.failed[way.name] = f"did not lower: {type(error).__name__}"
        continue
      self.pending[way.name] = compile_pool.POOL.submit(
          functools.partial(compile_pool.compile_lowered, lowered))

  def status(self) -> str:
    """Where the choice stands, for the plan."""
    if self.rounds is not None:
      return (f"the calls run each way in turn, timed: {self.rounds.done} of "
              f"{self.rounds.total} done")
    waiting = sorted(w for w, f in self.pending.items() if not f.done())
    if waiting:
      return (f"calls run {self.running.name!r} while {', '.join(waiting)} "
              "compile beside them; then the ways are timed in the calls")
    return (f"calls run {self.running.name!r}; the ways are compiled and are "
            "timed from the next call")

  def call(self, chooser, owner, args, kwargs):
    """Run one top-level call of this signature."""
    if self.decision is not None:
      if self._served is None:
        self._served = owner._jit(gpu.WAYS[self.decision.way], top_level=True)
      return self._served(*args, **kwargs)
    if not self._lock.acquire(blocking=False):   # another call is timed now
      return owner._jit(self.running, top_level=True)(*args, **kwargs)
    try:
      self.calls += 1
      return self._step(chooser, owner, args, kwargs)
    finally:
      self._lock.release()

  def _step(self, chooser, owner, args, kwargs):
    running = owner._jit(self.running, top_level=True)
    try:
      name = self._next(chooser, owner, args, kwargs)
    except Exception as error:  # noqa: BLE001 - choosing never fails a call
      self._keep_running(chooser, f"timing failed ({_brief(error)})")
      name = None
    if name is None:
      return running(*args, **kwargs)
    jitted = owner._jit(gpu.WAYS[name], top_level=True)
    out = []

    def run():
      out.append(jitted(*args, **kwargs))
      return out[0]

    try:
      seconds = timing.time_call(name, run)
    except Exception as error:  # noqa: BLE001
      if not out and name == self.running.name:
        raise                   # the call itself failed, as under jax.jit
      self._keep_running(chooser, f"timing failed ({name}: {_brief(error)})")
      if name == self.running.name or _any_deleted(args, kwargs):
        if out:
          return out[0]
        raise
      return running(*args, **kwargs)
    self.rounds.record(name, seconds)
    if self.rounds.next() is None:
      self._finish(chooser, self._decide())
    return out[0]

  def _next(self, chooser, owner, args, kwargs) -> str | None:
    """The way this call is timed on, or None (it runs ``running``)."""
    if self.rounds is None:
      if any(not f.done() for f in self.pending.values()):
        return None
      for name, future in self.pending.items():
        try:
          self.compiled[name], self.compile_seconds[name] = future.result()
        except Exception as error:  # noqa: BLE001 - a way XLA cannot compile
          self.failed[name] = f"did not compile: {_brief(error)}"
      self.pending = {}
      if self.preset is not None:
        if self.preset.way in self.compiled:
          self._finish(chooser, self.preset, store_it=False)
        else:
          self._keep_running(chooser, f"the kept way {self.preset.way!r} "
                             f"{self.failed.get(self.preset.way, 'failed')}")
        return None
      self._warm_up(chooser, owner, args, kwargs)
      if self.rounds is None:
        return None
    return self.rounds.next()

  def _warm_up(self, chooser, owner, args, kwargs) -> None:
    """Run every compiled way once on copies of this call's arguments;
    start the rounds with those that ran, or decide without them."""
    self.compiled[self.running.name] = owner._jit(
        self.running, top_level=True).trace(*args, **kwargs).lower().compile()
    self.memory = {w: timing.memory_needed(c) for w, c in self.compiled.items()}
    self.footprints = {w: memory.footprint(c) for w, c in self.compiled.items()}
    big = memory.too_big(self.memory, memory.free_bytes(self.device))
    self.failed.update(big)
    if self.running.name in big:
      self._finish(chooser, timing.Decision(
          self.running.name, f"kept {self.running.name!r}: it does not fit "
          "in the device's free memory twice, so no way was run beside it",
          self._trials({})))
      return
    dynamic = owner._spec.dynamic_arguments(args, kwargs)
    warmup = {}
    for way in self.ways:
      compiled = self.compiled.get(way.name)
      if compiled is None or way.name in self.failed:
        continue
      copies = _copies(dynamic)
      try:
        warmup[way.name] = timing.time_call(
            way.name, lambda: compiled(*copies[0], **copies[1]))
      except Exception as error:  # noqa: BLE001 - a way that cannot run
        self.failed[way.name] = f"failed to run: {_brief(error)}"
    self.compiled = {}
    if self.running.name not in warmup or len(warmup) < 2:
      self._finish(chooser, timing.Decision(
          self.running.name, f"kept {self.running.name!r}: no other way "
          "could be timed", self._trials({})))
      return
    self.rounds = timing.Rounds(warmup)

  def _decide(self) -> timing.Decision:
    per_round = self.rounds.per_round()
    baseline = "inline" if "inline" in per_round else self.running.name
    return timing.decide(per_round, baseline=baseline, trials=self._trials,
                         memory=self.memory)

  def _trials(self, medians: dict[str, float]) -> tuple[timing.Trial, ...]:
    return tuple(timing.Trial(w.name, medians.get(w.name),
                              self.memory.get(w.name),
                              self.failed.get(w.name, ""))
                 for w in self.ways)

  def _keep_running(self, chooser, why: str) -> None:
    self._finish(chooser, timing.Decision(
        self.running.name, f"kept {self.running.name!r}: {why}",
        self._trials({})), store_it=False)

  def _finish(self, chooser, decision: timing.Decision,
              store_it: bool = True) -> None:
    if not decision.cached:
      extra = sum(self.compile_seconds.values())
      decision = dataclasses.replace(decision, timing=(
          f"decided at call {self.calls} of this signature, "
          f"{time.perf_counter() - self.started:.2f} s after its first; "
          f"{extra:.2f} s of compiles beside the calls"))
      if store_it and self.disk_key is not None:
        timing.store(self.disk_key, decision)
    self.decision = decision
    self.pending, self.compiled, self.rounds = {}, {}, None
    chooser.refresh()


def _brief(error: Exception) -> str:
  return f"{type(error).__name__}: {str(error)[:200]}"
