"""The benchmark scripts' own logic: prefetch_sweep's step calibration, and
that cpu_dispatch_gap's measuring process runs. Correctness only: the
calibration is driven with made-up step times, and no timing is asserted.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _load(name):
  spec = importlib.util.spec_from_file_location(
      f"_benchmark_{name}", BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


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


def test_dispatch_gap_measuring_process_reports_every_gap():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  proc = subprocess.run(
      [sys.executable, str(BENCHMARKS / "cpu_dispatch_gap.py"), "--child",
       "sync", "--steps", "3", "--rounds", "1"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  gap = _load("cpu_dispatch_gap")
  assert set(result["per_step_us"]) == {str(g) for g in gap.GAPS_US}
  assert result["extra_us"]["0"] == 0.0
  assert isinstance(result["iters"], int) and result["iters"] >= 1
