"""The benchmark scripts: prefetch_sweep's step calibration, driven with
made-up step times, and every script but the suite (test_benchmark_suite.py)
run at about its smallest. Correctness only: no timing is asserted.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jaxstreams
import pytest
from jaxstreams.lower import gpu
from programs import gpu_target_problem, load_benchmark, require_gpu_target

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _load(name):
  return load_benchmark(name)


@pytest.fixture(scope="module")
def sweep():
  return _load("prefetch_sweep")


def _fake_timer(monkeypatch, sweep, ms_of):
  """Replaces the timer with ``ms_of(iters)``; returns the counts timed."""
  timed = []

  def fake(w, batch, iters, **_):
    timed.append(iters)
    return ms_of(iters)
  monkeypatch.setattr(sweep, "_ms_per_step", fake)
  return timed


def test_calibration_recovers_from_a_mistimed_first_point(monkeypatch, sweep):
  # 25 us fixed, 1.2 us per iteration, but the 1-iteration point timed at
  # 86 us (threads waking from idle): the first guess is far too short.
  def ms_of(iters):
    return 0.086 if iters == 1 else 0.025 + 0.0012 * iters
  timed = _fake_timer(monkeypatch, sweep, ms_of)
  iters, ms = sweep.calibrate(None, None, 0.1)
  assert iters in timed
  assert ms == ms_of(iters)
  assert abs(ms - 0.1) <= 0.01, (iters, ms, timed)


def test_calibration_returns_the_count_timed_closest(monkeypatch, sweep):
  # Steps that jump past the target: no count lands within 10%, so the
  # count returned is the timed one nearest the target, never an untimed
  # correction.
  def ms_of(iters):
    return 0.05 if iters < 40 else 0.2
  timed = _fake_timer(monkeypatch, sweep, ms_of)
  iters, ms = sweep.calibrate(None, None, 0.1)
  assert iters in timed
  assert ms == ms_of(iters)
  assert all(abs(ms - 0.1) <= abs(ms_of(n) - 0.1) for n in timed)


def test_calibration_stops_at_one_iteration_when_that_is_too_long(
    monkeypatch, sweep):
  def ms_of(iters):
    return 0.2 + 0.001 * iters
  timed = _fake_timer(monkeypatch, sweep, ms_of)
  assert sweep.calibrate(None, None, 0.1) == (1, ms_of(1))
  assert len(timed) == 2           # the two points of the first line only


# Each script at about its smallest run (seconds each), into a temporary
# directory: that it runs to the end and saves what it says it saves.
# Benchmarks are run on purpose, not by CI; this catches a change to a shared
# helper or to jaxstreams that breaks one of them.
SMALLEST_RUNS = {
    "serve": (["--seconds", "0.05", "--rounds", "1", "--threads", "1,4"],
              "serve_{platform}.json"),
    "prefetch_sweep": (["--steps", "5", "--rounds", "1", "--step-ms", "0.1,1"],
                       "prefetch_sweep_{platform}_steps0.1-1.json"),
    "cpu_dispatch_gap": (["--steps", "3", "--rounds", "1"],
                         "cpu_dispatch_gap_{platform}_jax*.json"),
    "prefetch": (["--steps", "5", "--repeats", "1", "--transfer-steps", "5",
                  "--transfer-mb", "0.25"], "prefetch_{platform}.json"),
    "jit_overhead": (["--calls", "20", "--batches", "2", "--quick",
                      "--models", "demo,transformer_one_stream"],
                     "jit_overhead_{platform}_jax*_quick.json"),
    "planning": (["--sizes", "100", "--reps", "1"], "planning_{platform}.json"),
    "gpu_levers": (["--quick"], "gpu_levers_{platform}_jax*_quick.json"),
    # The models users write (flax.linen here: the smallest program of
    # them), one way besides jax.jit and the default: compiles are slow.
    "gpu_levers:models": (["--quick", "--models", "linen_12_12", "--ways",
                           "jaxstreams loops"],
                          "gpu_levers_linen_12_12_{platform}_jax*_quick.json"),
    "xla_graphs": (["--quick"], "xla_graphs_h100_jax*_quick.json"),
    "memory_ways": (["--quick"], "memory_ways_h100_jax*_quick.json"),
    "estimated_default": (["--quick"],
                          "estimated_default_h100_jax*_quick.json"),
}


@pytest.mark.once
@pytest.mark.parametrize("script", [
    pytest.param(name, marks=pytest.mark.slow(
        reason="serve's smallest run still serves each model from one and "
        "four threads: 30 s and more")) if name == "serve" else name
    for name in sorted(SMALLEST_RUNS)])
def test_benchmark_script_runs_and_saves(script, tmp_path):
  args, saved = SMALLEST_RUNS[script]
  script, _, part = script.partition(":")
  if script in ("xla_graphs", "memory_ways", "estimated_default"):
    require_gpu_target(f"{script} compiles for an H100")
  saved = saved.format(platform=jax.devices()[0].platform)
  env = dict(os.environ)
  env.pop("JAXSTREAMS_STREAMS", None)
  if (script in ("jit_overhead", "memory_ways", "estimated_default")
      and jax.default_backend() == "cpu"):
    env["JAX_PLATFORMS"] = "cpu"    # it compiles for an H100 without one
  # The jaxstreams this test imported (the installed one under
  # scripts/test.sh, with its runtime library), not whatever the script's
  # directory would find.
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(pathlib.Path(jaxstreams.__file__).parent.parent),
                  env.get("PYTHONPATH")) if p)
  proc = subprocess.run(
      [sys.executable, str(BENCHMARKS / f"{script}.py"), *args,
       "--out", str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, (
      f"{script} exited with {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}"
      f"\nstderr:\n{proc.stderr[-4000:]}")
  files = list(tmp_path.glob(saved))
  assert len(files) == 1, (saved, sorted(p.name for p in tmp_path.iterdir()))
  result = json.loads(files[0].read_text())
  assert "machine" in result or "device" in result, sorted(result)
  if script == "jit_overhead" and gpu_target_problem() is None:
    cases = {c["model"].split(", ")[-1]: c for c in result["first_calls"]}
    assert all(len(c["samples_s"]["jax.jit"]) == 1
               and len(c["samples_s"]["jaxstreams.jit"]) == 1
               for c in cases.values())
    beside = {name: set(c["after_first_call"][0]["compiled_beside_s"])
              for name, c in cases.items()}
    others = {w.name for w in gpu.candidates()} - {"inline"}
    assert {name: beside.get(name) for name in (
        "demo training step", "one stream")} == {"demo training step": others,
                                                 "one stream": set()}
  if script == "memory_ways":
    (found,) = result["programs"].values()
    ways = found["ways"]
    assert found["groups"] == 1
    assert all(ways[w]["arguments"] == ways["jax.jit"]["arguments"]
               for w in ("jax.jit", "concurrent", "loops_concurrent", "nested"))
    assert found["nested_bound_bytes"] >= (ways["nested"]["temp"]
                                           - ways["jax.jit"]["temp"])
  if script == "gpu_levers":
    for case in result["cases"]:
      assert all("held_mb" in way["memory"]
                 for name, way in case["ways"].items()
                 if not name.startswith("pytorch")), case["ways"]
  if part == "models":
    (case,) = result["cases"]
    assert case["model"] == "linen_12_12"
    assert set(case["ways"]) == {"jax.jit", "jaxstreams loops",
                                 "jaxstreams default"}
    assert case["pytorch"] in ("timed", "PyTorch is not installed",
                               "PyTorch sees no CUDA device")
  if script == "estimated_default":
    # With defaults, for an H100 without one: scanned towers and a dual
    # encoder side by side (loops no GPU run measured: extrapolated, the
    # estimate does not decide), the two-tower step and the Inception-style
    # one as CONCURRENT graphs (held out, the estimate of CONCURRENT was off
    # by more than 20%: it does not decide); the reason names the rule.
    found = result["programs"]
    assert {n: (p["structural"], p["estimated"]) for n, p in found.items()} == {
        "scan_towers": ("loops_concurrent", "loops_concurrent"),
        "dual_encoders": ("loops_concurrent", "loops_concurrent"),
        "demo": ("concurrent", "concurrent"),
        "inception": ("concurrent", "concurrent")}
    assert all("estimated for h100 (the target the arguments are on; "
               "the structural way against 'inline'), not timed"
               in p["reason"] for p in found.values())
    assert all("extrapolated and does not decide" in found[n]["reason"]
               for n in ("scan_towers", "dual_encoders"))
    assert all("off by more than 20% for these ways, so it does not decide"
               in found[n]["reason"] for n in ("demo", "inception"))
  if script == "xla_graphs":
    rows = result["programs"]["four_branches"]
    assert rows["jax.jit"]["parallelism"] >= 1.0
    assert rows["default"]["pairs_side_by_side"][1] == 3
  if script == "cpu_dispatch_gap":
    gaps = {str(g) for g in _load("cpu_dispatch_gap").GAPS_US}
    for dispatch in ("async_dispatch", "sync_dispatch"):
      assert set(result[dispatch]["per_step_us"]) == gaps
      assert result[dispatch]["extra_us"]["0"] == 0.0
  if script == "prefetch_sweep":
    rows = result["rows"]
    assert {(r["step_ms_target"], r["producer"], r["read_every_step"])
            for r in rows} == {(0.1, "free", True), (0.1, "free", False),
                               (1.0, "free", True), (1.0, "free", False),
                               (1.0, "io", True), (1.0, "io", False)}
    assert all(r["step_ms_calibrated"] > 0 for r in rows)


@pytest.mark.once
def test_jax_tests_tells_what_fails_only_when_swapped(tmp_path):
  """jax_tests.py on a made-up JAX source tree: one test that passes both
  ways, one that tells jax.jit from jaxstreams.jit, one skipped."""
  tests = tmp_path / "jax" / "tests"
  tests.mkdir(parents=True)
  (tests / "api_test.py").write_text(
      "import jax, pytest\n"
      "def f(x):\n  return x + 1\n"
      "def test_same_result():\n  assert jax.jit(f)(1) == 2\n"
      "def test_kind():\n"
      "  assert type(jax.jit(f)).__name__ == 'PjitFunction'\n"
      "def test_skipped():\n  pytest.skip('nothing to do')\n")
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(pathlib.Path(jaxstreams.__file__).parent.parent),
                  env.get("PYTHONPATH")) if p)

  def run(test_file):
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "jax_tests.py"), "--jax-src",
         str(tmp_path / "jax"), "--source", "made-up", "--files", test_file,
         "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    [saved] = tmp_path.glob(f"jax_tests_{jax.devices()[0].platform}_jax*.json")
    return json.loads(saved.read_text())

  result = run("api_test")
  assert result["not_run"] == []
  tally = result["files"]["api_test"]
  assert tally["plain"] == {"passed": 2, "failed": 0, "skipped": 1}
  assert tally["swapped"] == {"passed": 1, "failed": 1, "skipped": 1}
  assert tally["fail_only_swapped"] == ["api_test::test_kind"]
  assert tally["fail_only_plain"] == []
  # A run of another file keeps this one's tally.
  (tests / "core_test.py").write_text("def test_nothing():\n  pass\n")
  result = run("core_test")
  assert result["files"]["api_test"] == tally
  assert result["files"]["core_test"]["swapped"]["passed"] == 1
