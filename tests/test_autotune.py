"""Choosing the GPU way of a function's top-level calls, tested on CPU: real
compiles and runs of every candidate, a fake clock that says which is
faster, and jaxstreams told that the arguments are on a GPU. Nothing here
depends on how long anything took."""

import json
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from jaxstreams import _compat
from jaxstreams.choose import compile_pool, dispatch, timing
from jaxstreams.lower import gpu, memory
from programs import (assert_equal_results, one_chain, random_inputs,
                      towers_args, tuned_towers, two_towers,
                      wait_until)
from programs import compiles, on_a_gpu  # noqa: F401 - fixtures


class FakeClock:
  """Seconds per call for each way (a number, or one per call in order);
  records how often each ran."""

  def __init__(self, seconds):
    self.seconds = seconds
    self.calls = {}

  def __call__(self, way, run):
    jax.block_until_ready(run())   # the candidate really runs
    n = self.calls.get(way, 0)
    self.calls[way] = n + 1
    value = self.seconds[way]
    return value[n] if isinstance(value, list) else value


def _clock(fastest=None, seconds=10e-3):
  """Every candidate ``seconds`` a call, ``fastest`` half that. Calls of
  10 ms make a round one call of each way."""
  return FakeClock({w.name: seconds / 2 if w.name == fastest else seconds
                    for w in gpu.WAYS.values()})


# ---------------------------------------------------------------------------
# The rule, on its own.

def _decide(clock, memory=None):
  """Warm up, then run the rounds, as a function's calls do. ``memory``:
  the bytes XLA says each way needs."""
  run = lambda: jnp.ones(2)
  rounds = timing.Rounds({w: clock(w, run) for w in clock.seconds})
  while (way := rounds.next()) is not None:
    rounds.record(way, clock(way, run))
  trials = lambda medians: tuple(
      timing.Trial(w, medians.get(w), (memory or {}).get(w))
      for w in clock.seconds)
  return timing.decide(rounds.per_round(), baseline="inline", trials=trials,
                       memory=memory)


def test_the_fastest_way_is_kept_when_it_clearly_wins():
  clock = FakeClock({"inline": 1e-3, "concurrent": 0.5e-3,
                     "streams_concurrent": 0.8e-3})
  decision = _decide(clock)
  assert decision.way == "concurrent"
  assert "2.00x of 'inline', won 5 of 5 rounds" in decision.reason
  assert {t.way: t.seconds for t in decision.trials} == pytest.approx(
      {"inline": 1e-3, "concurrent": 0.5e-3, "streams_concurrent": 0.8e-3})
  # A round of each gives every way at least ROUND_SECONDS of calls.
  assert clock.calls["concurrent"] == 1 + timing.ROUNDS * 10


def test_jax_jit_s_program_stays_unless_beaten_beyond_noise():
  assert _decide(
      FakeClock({"inline": 1e-3, "concurrent": 0.99e-3})).way == "inline"
  assert _decide(
      FakeClock({"inline": 1e-3, "concurrent": 1.2e-3})).way == "inline"
  # Faster in the median, but in one round of five only. Calls of 10 ms
  # make one call a round: the warm-up, then rounds 1 to 5.
  ms = lambda *values: [v * 1e-3 for v in values]
  split = FakeClock({"inline": ms(10, 1, 1, 10, 10, 10),
                     "concurrent": ms(10, 2, 2, 9, 11, 11)})
  decision = _decide(split)
  assert decision.way == "inline"
  assert "won 1 of 5 rounds" in decision.reason


def test_a_way_that_needs_more_memory_must_gain_more():
  """Half again jax.jit's memory asks 13% (3% noise, 20% per multiple of
  the memory added); the same gain with no more memory is enough."""
  assert timing.required_gain(1.5) == pytest.approx(0.13)
  assert timing.required_gain(2.0) == pytest.approx(0.23)
  assert (timing.required_gain(0.9) == timing.required_gain(None)
          == timing.MIN_GAIN)
  mb = 2**20
  clock = lambda: FakeClock({"inline": 1e-3, "concurrent": 0.9e-3})
  hungry = _decide(clock(), {"inline": 100 * mb, "concurrent": 150 * mb})
  assert hungry.way == "inline"
  assert ("the fastest, 'concurrent', gained 10.0% and won 5 of 5 rounds "
          "(needs 13% for 1.50x the memory and most rounds)") in hungry.reason
  assert "concurrent 900.0 us, 150.0 MiB" in hungry.describe()
  assert _decide(clock(), {"inline": 100 * mb, "concurrent": 101 * mb}).way == \
      "concurrent"
  assert _decide(clock()).way == "concurrent"     # memory unknown: 3%
  bigger_gain = FakeClock({"inline": 1e-3, "concurrent": 0.85e-3})
  assert _decide(bigger_gain, {"inline": 100 * mb, "concurrent": 150 * mb}
                 ).way == "concurrent"


def test_a_slower_way_that_needs_no_more_memory_can_win():
  mb = 2**20
  clock = FakeClock({"inline": 1e-3, "loops_concurrent": 0.88e-3,
                     "concurrent": 0.92e-3})
  decision = _decide(clock, {"inline": 100 * mb, "loops_concurrent": 200 * mb,
                             "concurrent": 100 * mb})
  assert decision.way == "concurrent"
  assert decision.reason == (
      "chose 'concurrent': 1.09x of 'inline', won 5 of 5 rounds, 1.00x its "
      "memory; the fastest, 'loops_concurrent', gained 12.0% but needs 23% "
      "for 2.00x the memory")


def test_rounds_interleave_the_ways_in_a_rotating_order():
  rounds = timing.Rounds({"inline": 1.0, "concurrent": 1.0, "streams": 1.0},
                         rounds=3)
  order = []
  while (way := rounds.next()) is not None:
    order.append(way)
    rounds.record(way, 1.0)
  assert order == ["inline", "concurrent", "streams",
                   "concurrent", "streams", "inline",
                   "streams", "inline", "concurrent"]


# ---------------------------------------------------------------------------
# A function's calls.

def _decision(f, args, kwargs=None):
  return f._chooser.choice_for(args, kwargs or {}).decision


def _call_until_decided(f, args, expected, limit=200):
  """Call ``f`` until its choice for ``args`` is made; every result must be
  ``expected``. Returns how many calls it took."""
  for n in range(1, limit + 1):
    assert_equal_results(f(*args), expected)
    if _decision(f, args) is not None:
      return n
  raise AssertionError(f"no decision after {limit} calls: "
                       f"{f.plan(*args).gpu_reason}")


def _names():
  return [w.name for w in gpu.candidates()]


def test_the_first_call_runs_jax_jit_s_program_and_compiles_the_others_beside_it(  # noqa: E501
    on_a_gpu, monkeypatch, compiles):
  clock = _clock()
  monkeypatch.setattr(timing, "time_call", clock)
  f = jaxstreams.jit(tuned_towers(), streams=3)
  args = towers_args()
  assert_equal_results(f(*args), jax.jit(two_towers)(*args))
  assert clock.calls == {}                       # nothing timed yet
  inline = f._jit(gpu.WAYS["inline"], top_level=True)
  assert inline._cache_size() == 1               # jax.jit's program ran it
  assert all(f._jit(w, top_level=True)._cache_size() == 0
             for w in gpu.candidates() if w.name != "inline")
  # The other candidates compile in the background, each once.
  assert set(f._chooser.wait_compiled(args, {})) == set(_names()) - {"inline"}
  assert compiles.count("tuned_towers") == len(_names())
  assert "being timed" in f.plan(*args).gpu_reason


def test_the_calls_after_it_time_the_ways_and_switch_once(on_a_gpu, monkeypatch,
                                                          compiles):
  fastest = _names()[-1]
  clock = _clock(fastest)
  monkeypatch.setattr(timing, "time_call", clock)
  f = jaxstreams.jit(tuned_towers(), streams=3)
  switches = []
  point_to = f._point_to
  monkeypatch.setattr(f, "_point_to",
                      lambda t: (switches.append(t), point_to(t)))
  args = towers_args()
  expected = jax.jit(two_towers)(*args)
  f(*args)
  f._chooser.wait_compiled(args, {})
  calls = _call_until_decided(f, args, expected)
  # A warm-up of each way, then ROUNDS rounds of one call of each.
  assert clock.calls == {w: 1 + timing.ROUNDS for w in _names()}
  assert calls == timing.ROUNDS * len(_names())
  chosen = f._jit(gpu.WAYS[fastest], top_level=True)
  assert [type(t).__name__ for t in switches] == ["BySignature", "Watch"]
  assert f.func.top is chosen
  for _ in range(3):
    assert_equal_results(f(*args), expected)
  assert len(switches) == 2 and sum(clock.calls.values()) == (
      len(_names()) * (1 + timing.ROUNDS))      # nothing timed any more
  # Calls traced inside another jit go to the nested way.
  assert_equal_results(jax.jit(lambda *a: f(*a))(*args), expected)
  # Every program was compiled once: the chosen one serves calls from the
  # compile made beside the first call (the nested call was compiled as
  # part of the outer jit's program).
  assert compiles.count("tuned_towers") == len(_names())
  plan = f.plan(*args)
  assert plan.gpu_lowering == fastest
  assert "chosen in this signature's calls" in plan.gpu_reason
  assert f"decided at call {calls + 1} of this signature" in plan.gpu_reason
  # Kept on disk, keyed by the program, device kind and versions.
  (key, entry), = json.loads(on_a_gpu.read_text()).items()
  assert entry["way"] == fastest and f"jax {jax.__version__}" in key
  assert {t["way"] for t in entry["trials"]} == set(_names())


def test_the_cache_is_read_before_anything_is_compiled(on_a_gpu, monkeypatch,
                                                       compiles):
  fastest = _names()[-1]
  clock = _clock(fastest)
  monkeypatch.setattr(timing, "time_call", clock)
  args = towers_args()
  expected = jax.jit(two_towers)(*args)
  first = jaxstreams.jit(tuned_towers(), streams=3)
  first(*args)
  first._chooser.wait_compiled(args, {})
  _call_until_decided(first, args, expected)
  # Another process, here another function object, after jax forgot the
  # programs: it reads the decision before it compiles anything.
  jax.clear_caches()
  compiles.clear()
  clock.calls.clear()
  read_at = []
  load = timing.load
  monkeypatch.setattr(timing, "load",
                      lambda key: (read_at.append(len(compiles)), load(key))[1])
  submitted = []
  monkeypatch.setattr(compile_pool.POOL, "submit",
                      lambda fn: submitted.append(fn))
  again = jaxstreams.jit(tuned_towers(), streams=3)
  assert_equal_results(again(*args), expected)
  assert read_at == [0]
  assert compiles.count("tuned_towers") == 1 and not submitted
  assert clock.calls == {}
  assert again.func.top is again._jit(gpu.WAYS[fastest], top_level=True)
  assert ("chosen at an earlier run, kept on disk"
          in again.plan(*args).gpu_reason)


def test_the_choice_is_per_signature(on_a_gpu, monkeypatch):
  clock = _clock("concurrent")
  monkeypatch.setattr(timing, "time_call", clock)
  f = jaxstreams.jit(tuned_towers(), streams=3)
  small, large = towers_args(8), towers_args(32)
  f(*small)
  f._chooser.wait_compiled(small, {})
  _call_until_decided(f, small, jax.jit(two_towers)(*small))
  concurrent = f._jit(gpu.WAYS["concurrent"], top_level=True)
  assert f.func.top is concurrent
  # A new shape runs the function's way at its first call, is noticed, and
  # gets a choice of its own: here jax.jit's program.
  clock.seconds = _clock("inline").seconds
  f(*large)
  assert concurrent._cache_size() == 2
  assert isinstance(f.func, dispatch.BySignature)
  f._chooser.wait_compiled(large, {})
  _call_until_decided(f, large, jax.jit(two_towers)(*large))
  assert _decision(f, small).way == "concurrent"
  assert _decision(f, large).way == "inline"
  # Two ways in use: calls are looked up by signature.
  assert isinstance(f.func, dispatch.BySignature)
  inline = f._jit(gpu.WAYS["inline"], top_level=True)
  counts = clock.calls.copy()
  before = inline._cache_size(), concurrent._cache_size()
  assert_equal_results(f(*small), jax.jit(two_towers)(*small))
  assert_equal_results(f(*large), jax.jit(two_towers)(*large))
  assert (inline._cache_size(), concurrent._cache_size()) == before
  assert clock.calls == counts
  assert f.plan(*small).gpu_lowering == "concurrent"
  assert f.plan(*large).gpu_lowering == "inline"


def test_a_first_call_that_fails_leaves_nothing_half_done(
    on_a_gpu, monkeypatch):
  monkeypatch.setattr(timing, "time_call", _clock())

  def picky(x, w1, w2):
    if x.shape[0] != 8:
      raise ValueError("batches of 8 only")
    return two_towers(x, w1, w2)

  f = jaxstreams.jit(picky, streams=3)
  with pytest.raises(ValueError, match="batches of 8 only"):
    f(*towers_args(4))
  assert isinstance(f.func, dispatch.FirstCall) and not f._chooser.settled
  args = towers_args()
  assert_equal_results(f(*args), jax.jit(two_towers)(*args))
  assert f._chooser.deciding(args, {})
  f._chooser.wait_compiled(args, {})


def test_concurrent_compiles_are_bounded():
  pool = compile_pool.CompilePool(2)
  running, most, lock = [0], [0], threading.Lock()
  release = threading.Event()

  def job(i):
    with lock:
      running[0] += 1
      most[0] = max(most[0], running[0])
    release.wait(10)
    with lock:
      running[0] -= 1
    return i

  futures = [pool.submit(lambda i=i: job(i)) for i in range(6)]
  assert wait_until(lambda: running[0] == 2)
  assert [f.running() for f in futures].count(True) == 2   # the rest queued
  assert len(pool._threads) == 2
  assert {t.name for t in pool._threads} == {"jaxstreams-compile"}
  release.set()
  assert [f.result(10) for f in futures] == list(range(6))
  assert most[0] == 2
  assert wait_until(lambda: not pool._threads)   # they end once idle


def test_a_function_s_compiles_go_through_the_bounded_pool(
    on_a_gpu, monkeypatch):
  monkeypatch.setattr(timing, "time_call", _clock())
  pool = compile_pool.CompilePool(1)
  submitted = []

  def submit(fn):
    submitted.append(fn)
    return pool.submit(fn)
  monkeypatch.setattr(compile_pool.POOL, "submit", submit)
  f = jaxstreams.jit(tuned_towers(), streams=3)
  args = towers_args()
  f(*args)
  f._chooser.wait_compiled(args, {})
  assert len(submitted) == len(_names()) - 1


def test_only_the_candidates_are_compiled(on_a_gpu, monkeypatch, compiles):
  """A way the candidates leave out (one XLA cannot compile for the plan)
  is never compiled."""
  two = (gpu.WAYS["inline"], gpu.WAYS["concurrent"])
  monkeypatch.setattr(gpu, "candidates", lambda plan=None: two)
  monkeypatch.setattr(timing, "time_call", _clock("concurrent"))
  f = jaxstreams.jit(tuned_towers(), streams=3)
  args = towers_args()
  f(*args)
  f._chooser.wait_compiled(args, {})
  _call_until_decided(f, args, jax.jit(two_towers)(*args))
  assert compiles.count("tuned_towers") == 2
  assert {t.way for t in _decision(f, args).trials} == {"inline", "concurrent"}


def test_a_candidate_that_does_not_compile_never_fails_a_call(
    on_a_gpu, monkeypatch):
  clock = _clock(_names()[-1])
  monkeypatch.setattr(timing, "time_call", clock)

  def broken(lowered):
    raise RuntimeError("XLA refused")
  monkeypatch.setattr(compile_pool, "compile_lowered", broken)
  f = jaxstreams.jit(tuned_towers(), streams=3)
  args = towers_args()
  expected = jax.jit(two_towers)(*args)
  assert_equal_results(f(*args), expected)
  f._chooser.wait_compiled(args, {})
  _call_until_decided(f, args, expected)
  decision = _decision(f, args)
  assert (decision.way == "inline"
          and "no other way could be timed" in decision.reason)
  skipped = {t.way: t.skipped for t in decision.trials}
  assert all(skipped[w] == "did not compile: RuntimeError: XLA refused"
             for w in _names() if w != "inline")
  assert set(clock.calls) <= {"inline"}          # only inline's warm-up ran


def test_a_candidate_that_fails_to_run_never_runs_a_call(on_a_gpu, monkeypatch):
  good = _clock("concurrent")

  def clock(way, run):
    if way == "concurrent":
      raise RuntimeError("the kernel failed")
    return good(way, run)
  monkeypatch.setattr(timing, "time_call", clock)
  f = jaxstreams.jit(tuned_towers(), streams=3)
  args = towers_args()
  expected = jax.jit(two_towers)(*args)
  f(*args)
  f._chooser.wait_compiled(args, {})
  _call_until_decided(f, args, expected)
  decision = _decision(f, args)
  assert decision.way != "concurrent"
  assert {t.way: t.skipped for t in decision.trials}["concurrent"] == \
      "failed to run: RuntimeError: the kernel failed"
  assert "concurrent" not in good.calls


def test_timing_that_fails_never_fails_a_call(on_a_gpu, monkeypatch):
  warm_ups = _clock()

  def broken(way, run):
    if sum(warm_ups.calls.values()) < len(_names()):
      return warm_ups(way, run)
    run()
    raise RuntimeError("the clock broke")
  monkeypatch.setattr(timing, "time_call", broken)
  f = jaxstreams.jit(tuned_towers(), streams=3)
  args = towers_args()
  expected = jax.jit(two_towers)(*args)
  f(*args)
  f._chooser.wait_compiled(args, {})
  _call_until_decided(f, args, expected)
  plan = f.plan(*args)
  assert plan.gpu_lowering == "inline"           # the way that already ran
  assert ("timing failed (inline: RuntimeError: the clock broke)"
          in plan.gpu_reason)
  assert not on_a_gpu.exists()                   # a failure is not kept


def _pretend_memory(monkeypatch, sizes):
  """XLA's estimate of each program's memory: ``sizes["concurrent"]`` for
  the concurrent way's program, ``sizes[""]`` for every other."""
  concurrent = set()
  compile_ = compile_pool.compile_lowered

  def compile_and_note(lowered):
    compiled, seconds = compile_(lowered)
    if _compat.lowered_compiler_options(lowered) == gpu.CONCURRENT_GRAPHS:
      concurrent.add(id(compiled))
    return compiled, seconds
  monkeypatch.setattr(compile_pool, "compile_lowered", compile_and_note)
  monkeypatch.setattr(timing, "memory_needed", lambda compiled: (
      sizes["concurrent"] if id(compiled) in concurrent else sizes[""]))


def test_a_way_that_would_not_fit_is_not_run(on_a_gpu, monkeypatch):
  clock = _clock("concurrent")
  monkeypatch.setattr(timing, "time_call", clock)
  monkeypatch.setattr(memory, "free_bytes", lambda device: 1000)
  sizes = {"concurrent": 5000, "": 100}
  _pretend_memory(monkeypatch, sizes)
  f = jaxstreams.jit(tuned_towers(), streams=3)
  args = towers_args()
  f(*args)
  f._chooser.wait_compiled(args, {})
  expected = jax.jit(two_towers)(*args)
  _call_until_decided(f, args, expected)
  decision = _decision(f, args)
  assert "concurrent" not in clock.calls and decision.way != "concurrent"
  skipped = {t.way: t.skipped for t in decision.trials}
  assert "needs" in skipped["concurrent"] and skipped["inline"] == ""
  # jax.jit's program itself too big to run twice: nothing is run beside it.
  sizes[""] = 5000
  clock.calls.clear()
  jaxstreams.config.update("jaxstreams_autotune_cache", "none")   # f's is kept
  g = jaxstreams.jit(tuned_towers(), streams=3)
  g(*args)
  g._chooser.wait_compiled(args, {})
  _call_until_decided(g, args, expected)
  assert _decision(g, args).way == "inline" and clock.calls == {}
  assert "does not fit" in _decision(g, args).reason


def test_a_function_s_calls_weigh_memory_against_time(on_a_gpu, monkeypatch):
  """concurrent runs 10% faster than every other way but needs 1.5x their
  memory: jax.jit's program is kept, and the plan says why."""
  clock = FakeClock({w.name: 9e-3 if w.name == "concurrent" else 10e-3
                     for w in gpu.WAYS.values()})
  monkeypatch.setattr(timing, "time_call", clock)
  _pretend_memory(monkeypatch, {"concurrent": 1500, "": 1000})
  f = jaxstreams.jit(tuned_towers(), streams=3)
  args = towers_args()
  f(*args)
  f._chooser.wait_compiled(args, {})
  _call_until_decided(f, args, jax.jit(two_towers)(*args))
  assert _decision(f, args).way == "inline"
  assert clock.calls["concurrent"] == 1 + timing.ROUNDS   # it was timed
  plan = f.plan(*args)
  assert "needs 13% for 1.50x the memory" in plan.gpu_reason
  # The plan states what each candidate needed, from its compile.
  assert plan.memory.get("concurrent").needed == 1500
  assert plan.memory.ratio("concurrent") == 1.5
  assert ("device memory of each way (XLA's memory analysis of the "
          "candidates compiled on this GPU, this signature's") in str(plan)


def test_a_kept_decision_whose_way_no_longer_fits_is_made_again(
    on_a_gpu, monkeypatch):
  clock = _clock("concurrent")
  monkeypatch.setattr(timing, "time_call", clock)
  _pretend_memory(monkeypatch, {"concurrent": 1500, "": 1000})
  free = {"now": 10**9}
  monkeypatch.setattr(memory, "free_bytes", lambda device: free["now"])
  args = towers_args()
  expected = jax.jit(two_towers)(*args)
  first = jaxstreams.jit(tuned_towers(), streams=3)
  first(*args)
  first._chooser.wait_compiled(args, {})
  _call_until_decided(first, args, expected)
  assert _decision(first, args).way == "concurrent"   # 2x, at 1.5x memory
  # Another process finds it on disk, with less memory free than the way
  # needed: it compiles and times the ways again, and concurrent is out.
  free["now"] = 1200
  again = jaxstreams.jit(tuned_towers(), streams=3)
  again(*args)
  assert again._chooser.deciding(args, {})
  again._chooser.wait_compiled(args, {})
  _call_until_decided(again, args, expected)
  decision = _decision(again, args)
  assert not decision.cached and decision.way != "concurrent"
  assert {t.way: t.skipped for t in decision.trials}["concurrent"] == (
      "needs 1.5 KiB, 1.2 KiB free")


def test_donated_arguments_stay_safe(on_a_gpu, monkeypatch):
  clock = _clock("concurrent")
  monkeypatch.setattr(timing, "time_call", clock)

  def step(x, w1, w2):
    return x * two_towers(x, w1, w2)

  f = jaxstreams.jit(step, streams=3, donate_argnums=0)
  _, w1, w2 = towers_args()
  for n in range(3 + timing.ROUNDS * len(_names())):
    x = towers_args()[0]
    expected = jax.jit(step)(x, w1, w2)
    out = f(x, w1, w2)        # warm-ups ran on copies of their own
    assert_equal_results(out, expected)
    assert x.is_deleted()     # donated to the call itself, as jax.jit does
    if n == 0:
      f._chooser.wait_compiled((x, w1, w2), {})
  assert _decision(f, (x, w1, w2)).way == "concurrent"


def test_a_program_with_side_effects_is_not_timed(
    on_a_gpu, monkeypatch, compiles):
  clock = _clock()
  monkeypatch.setattr(timing, "time_call", clock)
  seen = []

  def noisy_towers(x, w1, w2):
    jax.debug.callback(lambda v: seen.append(np.asarray(v)), x.sum())
    return two_towers(x, w1, w2)

  f = jaxstreams.jit(noisy_towers, streams=3)
  for _ in range(3):
    f(*towers_args())
  jax.effects_barrier()
  assert clock.calls == {} and len(seen) == 3
  assert compiles.count("noisy_towers") == 1       # nothing beside it
  assert "side effects" in f.plan(*towers_args()).gpu_reason


def test_a_program_with_side_effects_runs_jax_jit_s_where_its_default_would_not_fit(  # noqa: E501
    on_a_gpu, monkeypatch, compiles):
  """Not timed, so nothing else is compiled: the default's own program is,
  and where XLA says it needs more than is free, jax.jit's runs."""
  monkeypatch.setattr(memory, "free_bytes", lambda device: 1000)

  def noisy_towers(x, w1, w2):
    jax.debug.callback(lambda v: None, x.sum())
    return two_towers(x, w1, w2)

  f = jaxstreams.jit(noisy_towers, streams=3)
  assert_equal_results(f(*towers_args()), jax.jit(two_towers)(*towers_args()))
  plan = f.plan(*towers_args())
  assert plan.gpu_lowering == "inline"
  assert re.search(r"side effects, which a warm-up would repeat; 'concurrent' "
                   r"needs [\d.]+ KiB on the device, 1000 B free: jax.jit's "
                   r"program instead", plan.gpu_reason), plan.gpu_reason
  assert compiles.count("noisy_towers") == 2       # the default's, jax.jit's


def test_nothing_is_timed_where_nothing_can_differ(
    on_a_gpu, monkeypatch, compiles):
  clock = _clock()
  monkeypatch.setattr(timing, "time_call", clock)
  one_stream = jaxstreams.jit(lambda x: jnp.sin(x) * 2, streams=3)
  one_stream(jnp.ones(4))
  assert one_stream.func is one_stream._jit(gpu.WAYS["inline"], top_level=True)

  def chained(x, w):
    return one_chain(x, w)

  f = jaxstreams.jit(chained, streams=3)
  x, w = random_inputs((8, 16), (16, 16))
  for _ in range(3):
    assert_equal_results(f(x, w), jax.jit(one_chain)(x, w))
  assert clock.calls == {} and compiles.count("chained") == 1
  plan = f.plan(x, w)
  assert plan.gpu_lowering == "inline" and "nothing to time" in plan.gpu_reason


def test_the_option_turns_it_off(on_a_gpu, monkeypatch, compiles):
  clock = _clock()
  monkeypatch.setattr(timing, "time_call", clock)
  jaxstreams.config.update("jaxstreams_autotune", False)
  f = jaxstreams.jit(tuned_towers(), streams=3)
  f(*towers_args())
  assert clock.calls == {} and not on_a_gpu.exists()
  assert compiles.count("tuned_towers") == 1
  plan = f.plan(*towers_args())
  assert (plan.gpu_lowering == "concurrent"
          and "jaxstreams_autotune is off" in plan.gpu_reason)


def test_ahead_of_time_gets_the_chosen_program_and_options(
    on_a_gpu, monkeypatch):
  monkeypatch.setattr(timing, "time_call", _clock("inline"))
  f = jaxstreams.jit(tuned_towers(), streams=3)
  args = towers_args()
  before = f.lower(*args)   # nothing timed yet: the top-level default
  assert before._lowering._compiler_options_kvs == tuple(
      gpu.CONCURRENT_GRAPHS.items())
  f(*args)
  f._chooser.wait_compiled(args, {})
  _call_until_decided(f, args, jax.jit(two_towers)(*args))
  assert f.plan(*args).gpu_lowering == "inline"
  assert not f.lower(*args)._lowering._compiler_options_kvs


def test_static_arguments_are_passed_to_the_candidates(on_a_gpu, monkeypatch):
  clock = _clock("concurrent")
  monkeypatch.setattr(timing, "time_call", clock)

  def scaled(x, w1, w2, n):
    return two_towers(x, w1, w2) * n

  f = jaxstreams.jit(scaled, streams=3, static_argnames="n")
  reference = jax.jit(scaled, static_argnames="n")
  args = towers_args()
  assert_equal_results(f(*args, n=3), reference(*args, n=3))
  f._chooser.wait_compiled(args, {"n": 3})
  for _ in range(timing.ROUNDS * len(_names())):
    assert_equal_results(f(*args, n=3), reference(*args, n=3))
  assert _decision(f, args, {"n": 3}).way == "concurrent"
  assert _decision(f, args, {"n": 4}) is None      # another signature


def test_every_way_shares_one_trace_per_signature(on_a_gpu, monkeypatch):
  """The candidates, the chosen way, the nested way and ``plan`` are jax.jit
  functions of their own, each traced by jax; the user's function is
  traced once per signature all the same, as under one jax.jit."""
  monkeypatch.setattr(timing, "time_call", _clock())
  traces = []

  def step(x, w1, w2):
    traces.append(x.shape)
    return two_towers(x, w1, w2)

  f = jaxstreams.jit(step, streams=3)
  args = towers_args()
  f.plan(*args)
  f(*args)
  f._chooser.wait_compiled(args, {})
  _call_until_decided(f, args, jax.jit(two_towers)(*args))
  jax.jit(lambda *a: f(*a))(*args)
  assert traces == [(8, 16)]
  f(*towers_args(4))
  assert traces == [(8, 16), (4, 16)]
  # Another stream count is another plan, and so is x64 (jax's trace
  # context): traced again, as jax.jit traces again.
  jaxstreams.jit(step, streams=4)(*args)
  assert traces[2:] == [(8, 16)]
  with jax.enable_x64(True):
    f(*args)
  assert traces[3:] == [(8, 16)]
  f._chooser.wait_compiled(towers_args(4), {})


def test_jax_clear_caches_clears_the_shared_plans(on_a_gpu, monkeypatch):
  """After ``jax.clear_caches()`` jax.jit traces again and sees what the
  function reads now; so does every program of a jaxstreams.jit function."""
  monkeypatch.setattr(timing, "time_call", _clock())
  scale = {"now": 2.0}

  def step(x, w1, w2):
    return two_towers(x, w1, w2) * scale["now"]

  f = jaxstreams.jit(step, streams=3)
  args = towers_args()
  f(*args)
  f._chooser.wait_compiled(args, {})
  scale["now"] = 3.0
  jax.clear_caches()
  assert_equal_results(f(*args), jax.jit(step)(*args))
  assert_equal_results(jax.jit(lambda *a: f(*a))(*args), jax.jit(step)(*args))


@pytest.mark.cpu_backend
def test_on_cpu_calls_go_straight_to_jax_jit():
  f = jaxstreams.jit(two_towers, streams=3)
  f(*towers_args())
  assert type(f.func).__name__ == "PjitFunction"
