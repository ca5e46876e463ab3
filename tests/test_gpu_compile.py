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

from jaxstreams import _compat
from jaxstreams._compat import XLA_SCHEDULES_STREAM_CALLS
from programs import require_gpu_target

# These read the GPU program's stream calls (or compare programs that have
# them): jaxstreams.jit functions are made with the 'streams' lowering.
pytestmark = pytest.mark.usefixtures("stream_calls")

HERE = pathlib.Path(__file__).resolve().parent


def _compile_in_child(script):
  """The JSON line a deviceless-compile script prints, run in a process of
  its own (deviceless compilation needs JAX_PLATFORMS=cpu before jax starts)."""
  require_gpu_target()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, str(HERE / script)],
                          env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def schedules():
  return _compile_in_child("gpu_compile_programs.py")


PROGRAMS = ["two_towers", "two_tower_demo", "four_branches", "dlrm_towers",
            "one_chain"]
# The programs whose plans let regions run together.
OVERLAPPING = ["two_towers", "two_tower_demo", "four_branches", "dlrm_towers"]


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_off_main_region_is_async_on_its_stream(schedules, name):
  report = schedules[name]
  found = sorted((r["plan_region"], r["stream"]) for r in report["regions"]
                 if not r["fragment"])
  assert found == sorted(tuple(c) for c in report["plan_calls"])
  assert report["synchronous"] == 0


@pytest.mark.parametrize("name", ["two_towers", "two_tower_demo",
                                  "four_branches", "dlrm_towers"])
def test_every_pair_the_plan_allows_is_found_in_the_schedule(schedules, name):
  pairs = schedules[name]["pairs"]
  assert pairs, "the plan has independent regions"
  assert all(together is not None for _, _, together in pairs)


@pytest.mark.parametrize("name", OVERLAPPING)
def test_regions_the_plan_lets_overlap_have_work_in_their_windows(
    schedules, name):
  regions = [r for r in schedules[name]["regions"] if not r["fragment"]]
  assert regions
  assert all(r["main_work"] or r["overlapping"] for r in regions), \
      schedules[name]["summary"]


@pytest.mark.parametrize("name", OVERLAPPING)
def test_every_pair_the_plan_allows_is_scheduled_together(schedules, name):
  """Where jaxstreams pins the order (XLA that does not schedule stream
  regions), every pair; where XLA schedules them itself, every pair its
  limit of regions in flight allows, and the notes name the limit."""
  report = schedules[name]
  together = [t for _, _, t in report["pairs"]]
  if not XLA_SCHEDULES_STREAM_CALLS:
    assert all(together), report["summary"]
    assert report["barriers"] > 0
  else:
    assert report["barriers"] == 0   # nothing changes where XLA schedules
    assert all(together) or (
        report["peak_in_flight"] == 2
        and any("parallel_async_compute_limit" in n for n in report["notes"]))


@pytest.mark.parametrize("name", ["four_branches/limit4", "dlrm_towers/limit4"])
def test_with_the_in_flight_limit_raised_every_pair_is_together(
    schedules, name):
  report = schedules[name]
  assert all(t for _, _, t in report["pairs"]), report["summary"]
  assert report["peak_in_flight"] == 3


def test_without_sequence_points_old_xla_runs_the_regions_one_at_a_time(
    schedules):
  """The mechanism, kept in view: with the option off, XLA before jax 0.12
  places each call-done right after its call-start, and the notes say why."""
  report = schedules["four_branches/unpinned"]
  assert report["barriers"] == 0
  if XLA_SCHEDULES_STREAM_CALLS:
    assert report["peak_in_flight"] >= 2
  else:
    assert report["peak_in_flight"] == 1
    assert not any(t for _, _, t in report["pairs"])
    assert any("jaxstreams_sequence_points" in n for n in report["notes"])


def test_independent_towers_overlap(schedules):
  """Two towers on streams 1 and 2: XLA runs one inside the other's window,
  and the main-stream work neither needs (cos(x).mean(), written after the
  towers' product) inside both."""
  report = schedules["two_towers"]
  assert report["pairs"] == [[0, 1, True]]
  assert report["peak_in_flight"] == 2
  assert all(r["main_work"] for r in report["regions"])


def test_one_chain_has_nothing_in_its_windows(schedules):
  report = schedules["one_chain"]
  assert report["pairs"] == []
  assert all(r["main_work"] == 0 and r["overlapping"] == []
             for r in report["regions"])
  assert report["peak_in_flight"] == 1
  assert report["barriers"] == 0   # nothing to overlap: the program is
                                   # left alone


@pytest.fixture(scope="module")
def eight_gpus():
  """examples/sharded_training.py's step compiled for a node of eight H100s
  with the 'streams' lowering (tests/gpu_compile_sharded.py)."""
  return _compile_in_child("gpu_compile_sharded.py")


def test_a_partitioned_step_compiles_for_eight_gpus_with_its_regions_in_place(
    eight_gpus):
  """XLA:GPU compiles no collective inside a stream call, and jax.jit's
  partitioner puts the gradients' all-reduce wherever the shardings meet:
  over several devices the regions stay in place."""
  report = eight_gpus["jit_partitioned"]
  assert report["plan_streams"] == [0, 1, 2]
  assert report["regions"] == [] and report["synchronous"] == 0
  assert report["collectives"], report["summary"]
  assert "over 8 devices" in report["gpu_reason"]


def test_shard_map_body_regions_are_async_calls_on_each_of_eight_gpus(
    eight_gpus):
  report = eight_gpus["shard_map"]
  assert report["plan_streams"] == [0]
  assert list(report["body_streams"].values()) == [[0, 1, 2]]
  streams = [r["stream"] for r in report["regions"] if not r["fragment"]]
  assert sorted(set(streams)) == [1, 2] and len(streams) >= 2
  assert report["synchronous"] == 0
  # The gradients' all-reduce runs on the main stream, outside every region.
  assert [c["opcode"] for c in report["collectives"]
          if c["opcode"].startswith("all-reduce")], report["summary"]


def test_shard_map_towers_are_side_by_side_in_what_each_gpu_launches(
    eight_gpus):
  """The towers' backward regions, on streams 1 and 2, may run at the same
  time in what every device launches (XLA's CONCURRENT mode): here on their
  own streams outside the CUDA graphs, with an all-reduce in flight beside
  one of them (below)."""
  report = eight_gpus["shard_map"]
  pairs = report["graph_pairs"]
  assert pairs and all(together for _, _, together in pairs), \
      report["graph_summary"]


def _gradient_reduced_beside_other_tower(report):
  """(all-reduce, the region it waits for, a region in flight beside it)
  where the two regions are on different streams off the main one and
  neither depends on the other: one tower's gradients all-reduced while
  the other tower computes. Regions are the shard_map body's plan regions."""
  regions = {r["index"]: r for r in report["body_regions"]}
  found = []
  for c in report["collectives"]:
    if not c["opcode"].startswith("all-reduce"):
      continue
    for waited in c["waits_for"]:
      for running in c["plan_regions_in_flight"]:
        if waited is None or running is None:
          continue
        a, b = regions[waited], regions[running]
        if (0 != a["stream"] != b["stream"] != 0 and running not in a["reaches"]
            and waited not in b["reaches"]):
          found.append((c["name"], waited, running))
  return found


def test_one_towers_gradient_all_reduce_runs_while_the_other_tower_computes(
    eight_gpus):
  """In the shard_map step, each tower's gradients are all-reduced on their
  own (jaxstreams keys each collective for XLA's combiners by the stream
  calls it waits for), and XLA starts one tower's all-reduce while the other
  tower's backward region still runs, on every jax version. Merged into one
  all-reduce, they would wait for both towers."""
  report = eight_gpus["shard_map"]
  found = _gradient_reduced_beside_other_tower(report)
  assert found, report["summary"]
  # What the GPU launches (XLA's CONCURRENT mode): the all-reduce is in no
  # CUDA graph (XLA puts no collective in one), and neither is the region
  # beside it: its kernels run on its own stream while the all-reduce moves
  # data.
  outside = {(o["region"], o["stream"]) for o in report["outside_graphs"]}
  streams = {r["index"]: r["stream"] for r in report["body_regions"]}
  assert any((running, streams[running]) in outside
             for _, _, running in found), report["graph_summary"]


@pytest.mark.xfail(
    _compat.jaxlib_version() >= (0, 12), strict=True,
    reason="jaxlib 0.12: every stream call's operands pass an optimization "
           "barrier (no constant may reach a call), and XLA's scheduler then "
           "runs the all-gathers before both towers (docs/xla.md)")
def test_an_all_gather_is_in_flight_while_a_tower_runs_on_its_stream(
    eight_gpus):
  """Collectives beside compute: with each tower on a stream of its own, XLA
  runs one tower while the other tower's weights are still being gathered
  (on every jax version; under jax.jit's own program nothing overlaps)."""
  report = eight_gpus["gathered_towers"]
  assert report["streams"] == [1, 2]
  gathers = [c for c in report["collectives"] if "all-gather" in c["opcode"]]
  assert len(gathers) == 2, report["summary"]
  assert any(c["regions_in_flight"] for c in gathers), report["summary"]


def test_spreading_puts_a_tower_beside_the_other_towers_all_gather(eight_gpus):
  """The same step with no stream blocks and spreading on: the cost model
  prices the all-gathers, leaves the main stream to them, moves a tower off
  it, and XLA runs that tower while the other all-gather is in flight."""
  report = eight_gpus["gathered_towers_spread"]
  [summary] = report["spread"]
  assert summary.startswith("spread: split pays"), summary
  gathers = [c for c in report["collectives"] if "all-gather" in c["opcode"]]
  assert any(c["regions_in_flight"] for c in gathers), report["summary"]
