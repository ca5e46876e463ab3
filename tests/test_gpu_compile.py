"""The examples' and benchmarks' programs compiled for an H100 on this machine
(no GPU needed): what XLA:GPU will run.

Needs the CUDA plugin at jaxlib's version (see jaxstreams.xla.target). Without
it these tests skip; with JAXSTREAMS_REQUIRE_GPU_TARGET=1 (scripts/test.sh
sets it) they fail instead, so CI cannot skip them silently. The programs are
compiled in one child process (tests/gpu_compile_programs.py), because
deviceless compilation needs JAX_PLATFORMS=cpu before jax starts.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxstreams.xla.target import install_command
from programs import gpu_target_problem

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def schedules():
  problem = gpu_target_problem()
  if problem:
    message = f"{problem}; {install_command()}"
    if os.environ.get("JAXSTREAMS_REQUIRE_GPU_TARGET") == "1":
      pytest.fail(f"JAXSTREAMS_REQUIRE_GPU_TARGET=1 but {message}")
    pytest.skip(message)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, str(HERE / "gpu_compile_programs.py")],
                          env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


PROGRAMS = ["two_towers", "two_tower_demo", "four_branches", "dlrm_towers", "one_chain"]


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_off_main_region_is_async_on_its_stream(schedules, name):
  report = schedules[name]
  found = sorted((r["plan_region"], r["stream"]) for r in report["regions"]
                 if not r["fragment"])
  assert found == sorted(tuple(c) for c in report["plan_calls"])
  assert report["synchronous"] == 0


@pytest.mark.parametrize("name", ["two_towers", "two_tower_demo", "four_branches",
                                  "dlrm_towers"])
def test_every_pair_the_plan_allows_is_found_in_the_schedule(schedules, name):
  pairs = schedules[name]["pairs"]
  assert pairs, "the plan has independent regions"
  assert all(together is not None for _, _, together in pairs)


def test_independent_towers_overlap(schedules):
  """Two towers on streams 1 and 2: XLA runs one inside the other's window."""
  report = schedules["two_towers"]
  assert report["pairs"] == [[0, 1, True]]
  assert report["peak_in_flight"] == 2


def test_one_chain_has_nothing_in_its_windows(schedules):
  report = schedules["one_chain"]
  assert report["pairs"] == []
  assert all(r["main_work"] == 0 and r["overlapping"] == [] for r in report["regions"])
  assert report["peak_in_flight"] == 1
