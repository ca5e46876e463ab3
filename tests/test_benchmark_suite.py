"""benchmarks/suite.py --quick runs and writes complete, parseable results.

Correctness only: the suite runs every workload once on tiny sizes in a
subprocess (from the repository root, with this process's environment), and
the test checks the files it writes and what they contain, never timings.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUITE = ROOT / "benchmarks" / "suite.py"
WORKLOADS = {"inception", "dlrm", "mlp_bank", "dual_encoder", "gru_bank",
             "ode_ensemble", "staging", "control"}
# Two runs of about half the suite's time each (--only: the dual encoder
# takes most), which two test workers share; together they run every
# workload.
HALVES = ("dual_encoder,staging",
          "inception,dlrm,mlp_bank,gru_bank,ode_ensemble,control")
STANDARD = ("jax.jit", "XLA CONCURRENT", "compute_on")
# Minutes per jax (see conftest.py).
pytestmark = [pytest.mark.once, pytest.mark.slow(
    reason="the suite's quick run of every workload, end to end: a minute "
    "or two a half")]


def _run_quick(out_dir, only):
  env = dict(os.environ)
  env.pop("JAXSTREAMS_STREAMS", None)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  proc = subprocess.run(
      [sys.executable, str(SUITE), "--quick", "--out", str(out_dir),
       "--only", only],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, (
      f"suite exited with {proc.returncode}\nstdout:\n{proc.stdout}\n"
      f"stderr:\n{proc.stderr[-4000:]}")
  return proc.stdout


def test_the_halves_are_every_workload():
  assert {w for half in HALVES for w in half.split(",")} == WORKLOADS
  assert sum(len(half.split(",")) for half in HALVES) == len(WORKLOADS)


@pytest.mark.parametrize("only", HALVES)
def test_quick_suite_writes_every_workload(tmp_path, only):
  workloads = set(only.split(","))
  stdout = _run_quick(tmp_path, only)
  jsons = list(tmp_path.glob("suite_*_quick.json"))
  assert len(jsons) == 1, (list(tmp_path.iterdir()), stdout)
  report = json.loads(jsons[0].read_text())
  platform = report["machine"]["platform"]

  # The machine and method are described.
  for field in ("platform", "device_kind", "jax", "cpu_model", "cpu_cores"):
    assert field in report["machine"], field
  assert report["quick"] is True
  assert report["method"]["statistic"] == "median"

  results = report["results"]
  assert {r["workload"] for r in results} == workloads
  for r in results:
    where = f"{r['workload']} {r['size']}"
    cand = r["candidate"]
    assert r["status"][cand] == "ok", where
    assert r["times_s"][cand] is not None and r["times_s"][cand] > 0, where
    assert r["agrees"], (where, r["max_rel_diff_vs_reference"])
    assert set(r["ratios"]) == set(r["baselines"]), where
    for b in r["baselines"]:
      status = r["status"][b]
      if status == "ok":
        assert r["times_s"][b] > 0 and r["ratios"][b] > 0, (where, b)
      else:   # not run: it has neither a time nor a ratio, and says why
        assert r["times_s"][b] is None and r["ratios"][b] is None, (where, b)
        assert status.startswith(("n/a", "error")), (where, b, status)
    for name, mem in r["memory"].items():   # null for candidates not run
      if r["status"][name] == "ok":
        assert set(mem) >= {"compiled_total_bytes", "device_peak_bytes"}, name
      else:
        assert mem is None, name
    if r["workload"] != "staging":
      assert set(STANDARD) <= set(r["baselines"]), where
      assert r["status"]["jax.jit"] == "ok", where
      if platform != "gpu":   # GPU-only baselines are marked, not faked
        assert r["status"]["XLA CONCURRENT"].startswith("n/a"), where
        assert r["status"]["compute_on"].startswith("n/a"), where
      # jaxstreams and the hand-written compute_on program place work on
      # the same streams (counted in the program lowered for CUDA).
      calls = r["annotated_calls_cuda_lowering"]
      assert calls.get("jaxstreams"), where
      assert set(calls["jaxstreams"]) == set(calls["compute_on"]), where
  if "mlp_bank" in workloads:
    assert "jax.vmap" in next(r for r in results
                              if r["workload"] == "mlp_bank")["baselines"]

  md = jsons[0].with_suffix(".md").read_text()
  assert md.startswith("# jaxstreams benchmark suite")
  for name in workloads:
    assert f"| {name} |" in md, name
  png = jsons[0].with_suffix(".png")
  if importlib.util.find_spec("matplotlib") is not None:
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  else:
    assert not png.exists()
    assert "skipping the chart" in stdout
