"""Autotuning the GPU way at the first top-level call, tested on CPU: real
compiles and runs of every candidate, a fake clock that says which is
faster, and jaxstreams told that the arguments are on a GPU."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from jaxstreams import _jit
from jaxstreams.lower import autotune, gpu
from programs import assert_equal_results, random_inputs, two_towers


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


def _choose(clock, memory=None, free_bytes=None):
  runs = {w: (lambda: jnp.ones(2)) for w in clock.seconds}
  return autotune.choose(runs, memory=memory or {}, free_bytes=free_bytes,
                         timer=clock)


def test_the_fastest_way_is_kept_when_it_clearly_wins():
  clock = FakeClock({"inline": 1e-3, "concurrent": 0.5e-3, "streams_concurrent": 0.8e-3})
  decision = _choose(clock)
  assert decision.way == "concurrent"
  assert "2.00x of 'inline', won 5 of 5 rounds" in decision.reason
  assert {t.way: t.seconds for t in decision.trials} == pytest.approx(
      {"inline": 1e-3, "concurrent": 0.5e-3, "streams_concurrent": 0.8e-3})
  # A round of each gives every way at least ROUND_SECONDS of calls.
  assert clock.calls["concurrent"] == 1 + autotune.ROUNDS * 10


def test_jax_jit_s_program_stays_unless_beaten_beyond_noise():
  assert _choose(FakeClock({"inline": 1e-3, "concurrent": 0.99e-3})).way == "inline"
  assert _choose(FakeClock({"inline": 1e-3, "concurrent": 1.2e-3})).way == "inline"
  # Faster in the median, but in one round of five only. Calls of 10 ms
  # make one call a round: the warm-up, then rounds 1 to 5.
  ms = lambda *values: [v * 1e-3 for v in values]
  split = FakeClock({"inline": ms(10, 1, 1, 10, 10, 10),
                     "concurrent": ms(10, 2, 2, 9, 11, 11)})
  decision = _choose(split)
  assert decision.way == "inline"
  assert "won 1 of 5 rounds" in decision.reason


def test_a_candidate_that_would_not_fit_is_not_run():
  clock = FakeClock({"inline": 1e-3, "concurrent": 0.5e-3, "streams_concurrent": 0.6e-3})
  decision = _choose(clock, memory={"inline": 100, "concurrent": 5000,
                                    "streams_concurrent": 200}, free_bytes=1000)
  assert "concurrent" not in clock.calls
  assert decision.way == "streams_concurrent"
  skipped = {t.way: t.skipped for t in decision.trials}
  assert "needs" in skipped["concurrent"] and skipped["inline"] == ""
  baseline_too_big = _choose(FakeClock({"inline": 1e-3, "concurrent": 1e-4}),
                             memory={"inline": 5000}, free_bytes=1000)
  assert baseline_too_big.way == "inline" and "does not fit" in baseline_too_big.reason


@pytest.fixture
def on_a_gpu(monkeypatch, tmp_path):
  """jaxstreams.jit told that arguments are on a GPU (the programs compile
  and run on CPU, where XLA ignores the GPU options), and a fresh cache."""
  monkeypatch.setattr(_jit, "_platform", lambda *a: "gpu")
  jaxstreams.config.update("jaxstreams_autotune", True)
  jaxstreams.config.update("jaxstreams_autotune_cache", str(tmp_path / "tune.json"))
  yield tmp_path / "tune.json"
  jaxstreams.config.reset("jaxstreams_autotune_cache")
  jaxstreams.config.reset("jaxstreams_autotune")


def _args():
  return random_inputs((8, 16), (16, 16), (16, 16))


def test_first_call_times_the_candidates_and_keeps_the_fastest(on_a_gpu, monkeypatch):
  fastest = gpu.candidates()[-1].name
  clock = FakeClock({w.name: (0.5e-3 if w.name == fastest else 1e-3)
                     for w in gpu.candidates()})
  monkeypatch.setattr(autotune, "time_call", clock)
  f = jaxstreams.jit(two_towers, streams=3)
  args = _args()
  assert_equal_results(f(*args), jax.jit(two_towers)(*args))
  assert set(clock.calls) == {w.name for w in gpu.candidates()}
  plan = f.plan(*args)
  assert plan.gpu_lowering == fastest
  assert "timed at the first call" in plan.gpu_reason and "us" in plan.gpu_reason
  # Top-level calls go to the chosen way's jax.jit function, calls traced
  # inside another jit to the nested way's.
  assert isinstance(f.func, _jit._switch)
  assert_equal_results(jax.jit(lambda *a: f(*a))(*args), jax.jit(two_towers)(*args))
  assert_equal_results(f(*args), jax.jit(two_towers)(*args))
  # Kept on disk, keyed by the program, device kind and versions.
  (key, entry), = json.loads(on_a_gpu.read_text()).items()
  assert entry["way"] == fastest and f"jax {jax.__version__}" in key
  assert {t["way"] for t in entry["trials"]} == {w.name for w in gpu.candidates()}
  # Another process (here: another function object) finds the decision.
  clock.calls.clear()
  g = jaxstreams.jit(two_towers, streams=3)
  g(*args)
  assert clock.calls == {}
  assert g.plan(*args).gpu_lowering == fastest
  assert "from the cache" in g.plan(*args).gpu_reason


def test_ahead_of_time_gets_the_chosen_program_and_options(on_a_gpu, monkeypatch):
  monkeypatch.setattr(autotune, "time_call", FakeClock(
      {w.name: (0.5e-3 if w.name == "inline" else 1e-3) for w in gpu.candidates()}))
  f = jaxstreams.jit(two_towers, streams=3)
  args = _args()
  before = f.lower(*args)   # nothing timed yet: the top-level default
  assert before._lowering._compiler_options_kvs == tuple(gpu.CONCURRENT_GRAPHS.items())
  f(*args)
  assert f.plan(*args).gpu_lowering == "inline"
  assert not f.lower(*args)._lowering._compiler_options_kvs


def test_the_option_turns_it_off(on_a_gpu, monkeypatch):
  clock = FakeClock({w.name: 1e-3 for w in gpu.candidates()})
  monkeypatch.setattr(autotune, "time_call", clock)
  jaxstreams.config.update("jaxstreams_autotune", False)
  f = jaxstreams.jit(two_towers, streams=3)
  f(*_args())
  assert clock.calls == {} and not on_a_gpu.exists()
  plan = f.plan(*_args())
  assert plan.gpu_lowering == "concurrent" and "jaxstreams_autotune is off" in plan.gpu_reason


def test_donated_arguments_are_not_consumed_by_the_candidates(on_a_gpu, monkeypatch):
  clock = FakeClock({w.name: 1e-3 for w in gpu.candidates()})
  monkeypatch.setattr(autotune, "time_call", clock)

  def step(x, w1, w2):
    return x * two_towers(x, w1, w2)

  f = jaxstreams.jit(step, streams=3, donate_argnums=0)
  x, w1, w2 = _args()
  expected = jax.jit(step)(x, w1, w2)
  out = f(x, w1, w2)      # the candidates ran first, on copies of their own
  assert clock.calls
  assert_equal_results(out, expected)
  assert x.is_deleted()   # donated to the call itself, as jax.jit does


def test_a_program_with_side_effects_is_not_timed(on_a_gpu, monkeypatch):
  clock = FakeClock({w.name: 1e-3 for w in gpu.candidates()})
  monkeypatch.setattr(autotune, "time_call", clock)
  seen = []

  def noisy(x, w1, w2):
    jax.debug.callback(lambda v: seen.append(np.asarray(v)), x.sum())
    return two_towers(x, w1, w2)

  f = jaxstreams.jit(noisy, streams=3)
  f(*_args())
  jax.effects_barrier()
  assert clock.calls == {} and len(seen) == 1
  assert "side effects" in f.plan(*_args()).gpu_reason


def test_one_stream_is_never_timed(on_a_gpu, monkeypatch):
  clock = FakeClock({w.name: 1e-3 for w in gpu.candidates()})
  monkeypatch.setattr(autotune, "time_call", clock)
  f = jaxstreams.jit(lambda x: jnp.sin(x) * 2, streams=3)
  f(jnp.ones(4))
  assert clock.calls == {}
  assert f.func is f._jit(gpu.WAYS["inline"], top_level=True)   # no switch


def test_static_arguments_are_passed_to_the_candidates(on_a_gpu, monkeypatch):
  clock = FakeClock({w.name: 1e-3 for w in gpu.candidates()})
  monkeypatch.setattr(autotune, "time_call", clock)

  def scaled(x, w1, w2, n):
    return two_towers(x, w1, w2) * n

  f = jaxstreams.jit(scaled, streams=3, static_argnames="n")
  args = _args()
  assert_equal_results(f(*args, n=3), jax.jit(scaled, static_argnames="n")(*args, n=3))
  assert clock.calls


def test_every_way_shares_one_trace_per_signature(on_a_gpu, monkeypatch):
  """The candidates, the chosen way, the nested way and ``plan`` are jax.jit
  functions of their own, each traced by jax; the user's function is
  traced once per signature all the same, as under one jax.jit."""
  monkeypatch.setattr(autotune, "time_call", FakeClock(
      {w.name: 1e-3 for w in gpu.candidates()}))
  traces = []

  def step(x, w1, w2):
    traces.append(x.shape)
    return two_towers(x, w1, w2)

  f = jaxstreams.jit(step, streams=3)
  args = _args()
  f.plan(*args)
  f(*args)
  jax.jit(lambda *a: f(*a))(*args)
  assert traces == [(8, 16)]
  f(*random_inputs((4, 16), (16, 16), (16, 16)))
  assert traces == [(8, 16), (4, 16)]
  # Another stream count is another plan, and so is x64 (jax's trace
  # context): traced again, as jax.jit traces again.
  jaxstreams.jit(step, streams=4)(*args)
  assert traces[2:] == [(8, 16)]
  with jax.enable_x64(True):
    f(*args)
  assert traces[3:] == [(8, 16)]


def test_jax_clear_caches_clears_the_shared_plans(on_a_gpu, monkeypatch):
  """After ``jax.clear_caches()`` jax.jit traces again and sees what the
  function reads now; so does every program of a jaxstreams.jit function."""
  monkeypatch.setattr(autotune, "time_call", FakeClock(
      {w.name: 1e-3 for w in gpu.candidates()}))
  scale = {"now": 2.0}

  def step(x, w1, w2):
    return two_towers(x, w1, w2) * scale["now"]

  f = jaxstreams.jit(step, streams=3)
  args = _args()
  f(*args)
  scale["now"] = 3.0
  jax.clear_caches()
  assert_equal_results(f(*args), jax.jit(step)(*args))
  assert_equal_results(jax.jit(lambda *a: f(*a))(*args), jax.jit(step)(*args))


@pytest.mark.cpu_backend
def test_on_cpu_calls_go_straight_to_jax_jit():
  f = jaxstreams.jit(two_towers, streams=3)
  f(*_args())
  assert type(f.func).__name__ == "PjitFunction"


def test_a_way_that_fails_is_reported_and_timing_never_fails_a_call(on_a_gpu, monkeypatch):
  clock = FakeClock({"inline": 1e-3, "concurrent": 1e-3})
  decision = autotune.choose({"inline": lambda: 1, "concurrent": lambda: 1},
                             memory={}, free_bytes=None, timer=clock,
                             failed={"streams_concurrent": "did not compile: X"})
  assert {t.way: t.skipped for t in decision.trials}["streams_concurrent"] == \
      "did not compile: X"
  assert "streams_concurrent" not in clock.calls

  def broken(*args, **kwargs):
    raise RuntimeError("the clock broke")
  monkeypatch.setattr(autotune, "choose", broken)
  f = jaxstreams.jit(two_towers, streams=3)
  args = _args()
  assert_equal_results(f(*args), jax.jit(two_towers)(*args))
  plan = f.plan(*args)
  assert plan.gpu_lowering == "concurrent"
  assert "timing failed (RuntimeError: the clock broke)" in plan.gpu_reason
