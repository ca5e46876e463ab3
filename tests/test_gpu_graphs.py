"""What an H100 would launch for the examples' and benchmarks' programs, as
jaxstreams lowers them by default: the CUDA graphs XLA:GPU builds, compiled
on this machine (no GPU; ``jaxstreams.xla_graphs`` compiles in a child
process with XLA's command-buffer log on).

The graph decides what runs side by side, not the HLO order. Needs the CUDA
plugin at jaxlib's version: without it these tests skip, and with
JAXSTREAMS_REQUIRE_GPU_TARGET=1 (scripts/test.sh sets it) they fail.
"""

import jax
import pytest

import jaxstreams
from jaxstreams._compat import XLA_SCHEDULES_STREAM_CALLS
from programs import require_gpu_target

import gpu_compile_programs as programs


@pytest.fixture(scope="module", autouse=True)
def plugin():
  require_gpu_target()


def _graphs(name, wrap=None, **jit_kwargs):
  """The graphs of program ``name`` as jaxstreams.jit lowers it for a GPU
  (called at top level, or inside ``wrap``), and its plan."""
  fn, args, streams = programs.PROGRAMS[name]()
  f = jaxstreams.jit(fn, streams=streams, **jit_kwargs)
  plan = f.plan(*args)
  outer = f if wrap is None else wrap(f)
  lowered = outer.trace(*args).lower(lowering_platforms=("cuda",))
  return jaxstreams.xla_graphs(lowered, plan=plan), plan


MULTI_BRANCH = ["two_tower_demo", "four_branches", "dlrm_towers"]


@pytest.fixture(scope="module")
def defaults():
  return {name: _graphs(name) for name in MULTI_BRANCH + ["one_chain"]}


@pytest.mark.parametrize("name", MULTI_BRANCH)
def test_by_default_independent_regions_run_side_by_side(defaults, name):
  graphs, plan = defaults[name]
  assert plan.gpu_lowering == "concurrent"
  assert graphs.parallelism >= 1.5, graphs.summary()
  checks = graphs.compare()
  assert checks and all(together for _, _, together in checks), graphs.summary()


def test_one_chain_stays_one_chain(defaults):
  graphs, _ = defaults["one_chain"]
  assert graphs.parallelism == 1.0, graphs.summary()


def test_stream_calls_under_xlas_defaults():
  """The reason for the default: stream calls are one chain in the graph of
  jaxlib 0.10 and 0.11 (what serialized two regions on an H100), and
  parallel branches from jaxlib 0.12."""
  graphs, _ = _graphs("four_branches", gpu_lowering="streams")
  (graph,) = graphs.graphs
  assert graph.mode in ("LHS", "Concurrent")
  if XLA_SCHEDULES_STREAM_CALLS:
    assert not graph.sequential and graph.parallelism > 1.2, graphs.summary()
    assert graphs.parallel_regions()
  else:
    assert graph.sequential and graph.parallelism == 1.0, graphs.summary()


def test_inside_another_jit():
  """No compiler option reaches a function traced inside another jit: from
  jax 0.12 its regions are stream calls, parallel branches of the outer
  program's graph; before, it is the program jax.jit builds."""
  graphs, plan = _graphs("four_branches",
                         wrap=lambda f: jax.jit(lambda *a: f(*a)))
  if XLA_SCHEDULES_STREAM_CALLS:
    assert "inside another jit: 'streams'" in plan.gpu_reason
    assert graphs.parallelism > 1.2, graphs.summary()
  else:
    assert "inside another jit: 'inline'" in plan.gpu_reason
    assert graphs.parallelism == 1.0, graphs.summary()


def test_grouped_serve_runs_its_requests_side_by_side():
  """A grouped batch's requests are regions: by default they are parallel
  branches of the graph (on the H100, stream calls ran them in one chain)."""
  w1, w2 = jax.numpy.ones((64, 256)) * 0.01, jax.numpy.ones((256, 64)) * 0.01

  def mlp(x):
    return jax.numpy.tanh(jax.numpy.tanh(x @ w1) @ w2).sum()

  with jaxstreams.serve(mlp, mode="grouped", groups=3) as server:
    fn = server.batch_function()
    requests = [((jax.numpy.ones((32, 64)) * (r + 1),), {}) for r in range(3)]
    plan = fn.plan(*requests)
    lowered = fn.trace(*requests).lower(lowering_platforms=("cuda",))
  graphs = jaxstreams.xla_graphs(lowered, plan=plan)
  checks = graphs.compare()
  assert len(checks) == 3 and all(t for _, _, t in checks), graphs.summary()
  assert graphs.parallelism >= 1.5, graphs.summary()


def test_a_staged_producer_runs_beside_the_consumer():
  """staged's fused program: the next batch's producer stage is a region
  beside the consumer's step, parallel in the graph by default."""
  import numpy as np
  w = jax.numpy.ones((64, 64)) * 0.01

  def step(w, batch):
    h = jaxstreams.stage(
        jax.numpy.tanh(jax.numpy.cumsum(jax.numpy.sin(batch), axis=1)))
    return jax.numpy.tanh(jax.numpy.tanh(h @ w) @ w).sum()

  data = [np.ones((128, 64), np.float32) * i for i in range(4)]
  with jaxstreams.staged(step, data=data, mode="fused") as runner:
    runner(w)
    program, args = runner.step_program()
    plan = program.plan(*args)
    lowered = program.trace(*args).lower(lowering_platforms=("cuda",))
  graphs = jaxstreams.xla_graphs(lowered, plan=plan)
  assert plan.gpu_lowering == "concurrent"
  assert graphs.parallelism > 1.0, graphs.summary()
  assert graphs.parallel_regions(), graphs.summary()
