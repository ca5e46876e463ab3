"""What an H100 launches for programs with loops, conditionals and
convolutions, as jaxstreams lowers them by default: compiled on this machine
without a GPU (``jaxstreams.xla_graphs``: XLA's command-buffer log and thunk
dump, read in a child process).

XLA runs a loop outside its CUDA graphs, kernel by kernel on the loop's
stream: under ``jax.jit`` two ``lax.scan`` towers run one after the other.
By default jaxstreams runs independent towers' loops as one loop whose step
runs each tower's body on its stream (``jaxstreams.lower.loops``); these
tests read, in what XLA compiled, that the towers' work is in flight
together, at top level and inside another jit, forward and backward. Needs
the CUDA plugin (see ``jaxstreams.xla.target``): skips without it, fails
with ``JAXSTREAMS_REQUIRE_GPU_TARGET=1``.
"""

import os
import sys

import jax
import pytest

import jaxstreams
from jaxstreams.lower import gpu
from jaxstreams.xla import kept_compiles
from programs import require_gpu_target

import compile_matrix
from jaxstreams._compat import jaxlib_version as _compat_jaxlib


@pytest.fixture(scope="module", autouse=True)
def plugin():
  require_gpu_target()


def _view(fn, args, streams, *, context="top", **jit_kwargs):
  """The view of ``fn`` as jaxstreams.jit lowers it for a GPU, called at
  top level, inside another jit, or differentiated inside one; its plan."""
  f = jaxstreams.jit(fn, streams=streams, **jit_kwargs)
  plan = f.plan(*args)
  if context == "top":
    outer = f
  elif context == "jit":
    outer = jax.jit(lambda *a: f(*a))
  else:
    outer = jax.jit(jax.grad(compile_matrix._scalar_loss(f),
                             argnums=compile_matrix._float_arguments(args)))
  lowered = outer.trace(*args).lower(lowering_platforms=("cuda",))
  return jaxstreams.xla_graphs(lowered, plan=plan), plan


def _program(name):
  return compile_matrix.PROGRAMS[name]()


def _tower_pairs(plan):
  """The pairs of regions the plan runs as one loop."""
  return {(g.regions[0], g.regions[1]) for g in plan.loops}


def _streams_of(graphs) -> dict[int, set[int]]:
  """The XLA streams each plan region's work is launched on: its kernels'
  in graphs, and its stream calls' outside them."""
  from jaxstreams.xla.launches import StreamCall
  found: dict[int, set[int]] = {}
  for g in graphs.graphs:
    for k in g.kernels:
      if k.region is not None:
        found.setdefault(k.region, set()).add(k.stream)
  for launch in graphs.program.walk():
    if isinstance(launch, StreamCall) and launch.planned:
      found.setdefault(launch.region, set()).add(launch.stream)
  return found


def _on_two_streams(graphs, pair) -> bool:
  streams = _streams_of(graphs)
  a, b = (streams.get(r, set()) - {0} for r in pair)
  return bool(a) and bool(b) and not a & b


@pytest.mark.parametrize("context", ["top", "jit"])
def test_scan_towers_run_side_by_side_by_default(context):
  fn, args, streams = _program("scan_towers")
  graphs, plan = _view(fn, args, streams, context=context)
  (pair,) = _tower_pairs(plan)
  assert pair in graphs.parallel_regions(), str(graphs)
  assert _on_two_streams(graphs, pair), str(graphs)
  (loop,) = graphs.loops   # one loop for both towers
  assert loop.trip_count == compile_matrix.LAYERS and not loop.host_waits


def test_scan_towers_training_step_runs_both_passes_side_by_side():
  """A training step (the gradient taken inside the jaxstreams.jit
  function): the forward loops run as one, and so do the backward loops."""
  fn, args, streams = _program("scan_towers")

  def step(w1, w2, x):
    return jax.value_and_grad(fn, argnums=(0, 1))(w1, w2, x)

  graphs, plan = _view(step, args, streams)
  assert len(plan.loops) == 2
  together = graphs.parallel_regions()
  assert all(p in together for p in _tower_pairs(plan)), str(graphs)
  assert all(_on_two_streams(graphs, p) for p in _tower_pairs(plan))
  assert len(graphs.loops) == 2
  # Each step's two body calls are inside the step's CUDA graph: with
  # CONCURRENT graphs the way lowers XLA's minimum graph size to two calls
  # (jaxstreams.lower.gpu.MIN_GRAPH_SIZE; XLA's default, 5, is not). On
  # jaxlib 0.12 the barrier over the step's results keeps XLA's own
  # asynchronous copies of the stacked outputs out of the calls' windows,
  # which would keep the calls out of any graph.
  from jaxstreams.xla.launches import GraphLaunch, StreamCall
  for loop in graphs.loops:
    calls = [l for l in loop.body if isinstance(l, StreamCall) and l.planned]
    assert not calls, str(graphs)
    assert any(isinstance(l, GraphLaunch) and len(l.graph.regions) == 2
               for l in loop.body), str(graphs)
  assert not graphs.outside, str(graphs)


@pytest.mark.parametrize("name, context", [
    ("dual_encoders", "top"), ("dual_encoders", "jit"),
    ("dual_encoders_train", "top"), ("dual_encoders_train", "jit")])
def test_dual_encoders_as_users_write_them_run_side_by_side(name, context):
  """Dual encoders of depths (4, 4), (6, 3) and (24, 12) (compile_matrix.
  ENCODERS), forward and training step, at top level and inside another
  jit: every pair of towers' loops runs as one loop with both bodies in
  flight in every step. (Towers inside wrappers: tests/test_loops.py.)"""
  fn, args, streams = _program(name)
  graphs, plan = _view(fn, args, streams, context=context)
  groups = 3 if name == "dual_encoders" else 6
  assert len(plan.loops) == groups, str(plan)
  assert {g.lengths for g in plan.loops} >= {(4, 4), (6, 3), (24, 12)}
  together = graphs.parallel_regions()
  apart = [p for p in _tower_pairs(plan) if p not in together]
  assert not apart, str(graphs)
  assert len(graphs.loops) == groups


@pytest.fixture(scope="module")
def nested_training_step():
  """The scan towers' training step called inside another jit (no
  compiler options reach it: ``loops`` before jaxlib 0.12, ``streams``
  from it), compiled once for the tests below."""
  fn, args, streams = _program("scan_towers")

  def step(w1, w2, x):
    return jax.value_and_grad(fn, argnums=(0, 1))(w1, w2, x)
  return _view(step, args, streams, context="jit")


def test_each_loop_step_runs_each_body_as_one_stream_call(nested_training_step):
  """A body that is one region is one call per loop step (or in the step's
  graph), forward and backward, on every jaxlib. XLA from 0.11 makes a call
  of its own of each annotated instruction, and its translation gives the
  get-tuple-element of each result of a call the call's attributes: a body
  of k results was 1 + k calls a step, each with its events (#48), unless
  the call returns one tuple (``_compat.results_through_one_tuple``)."""
  from jaxstreams.xla.launches import GraphLaunch, StreamCall
  graphs, plan = nested_training_step
  groups = {frozenset(g.regions) for g in plan.loops}
  assert len(graphs.loops) == len(groups) == 2, str(graphs)
  for loop in graphs.loops:
    calls = [l.region for l in loop.body
             if isinstance(l, StreamCall) and l.planned]
    # Or none, where XLA put the step's calls into one graph (jaxlib 0.12).
    graphed = {r for l in loop.body if isinstance(l, GraphLaunch)
               for r in l.graph.regions}
    assert len(calls) == len(set(calls)) and (
        frozenset(calls) in groups if calls else frozenset(graphed) in groups
    ), graphs.launch_order()
  assert "calls)" not in graphs.summary()
  assert all(p in graphs.parallel_regions() for p in _tower_pairs(plan))


def test_xla_makes_a_call_of_each_annotated_result():
  """What the one-tuple result works around (jaxlib 0.11 and 0.12; 0.10
  wraps calls only): a call with two results and the stream annotation
  becomes three stream calls; jaxstreams' region call stays one."""
  import jax.numpy as jnp
  from jaxstreams import _compat
  from jaxstreams.lower.calls import install_region_rules, stream_call
  install_region_rules()
  target = jaxstreams.gpu_target("h100")
  x = jnp.ones((8, 128))
  body = lambda x: (jnp.tanh(x), jnp.cos(x))

  def call_starts(fn):
    text = jax.jit(fn).lower(*target.abstract(x)).compile().as_text()
    return text.count(" call-start(")

  plain = _compat.xla_metadata_call(
      body, _xla_stream_annotation="1", inlineable="false")
  assert call_starts(lambda x: sum(plain(x))) == (
      3 if _compat_jaxlib() >= (0, 11) else 1)
  assert call_starts(lambda x: sum(stream_call(body, 1, 0)(x))) == 1


# From jaxlib 0.11 nothing is packed: one case to compile, not two alike.
@pytest.mark.parametrize("packed", [True, False] if _compat_jaxlib() < (0, 11)
                         else [False])
def test_jaxlib_0_10_runs_multi_result_calls_in_turn(packed, monkeypatch):
  """What _compat.MULTI_RESULT_CALLS_RUN_IN_TURN records: jaxlib 0.10's
  scheduler runs a stream call with several results to its done before
  the next one starts, so a training step's towers (whose forward bodies
  return residuals) run one after the other unless each body returns its
  results in one buffer; later XLA runs them side by side either way. Seen
  inside another jit, where the bodies' calls run outside the graphs (at
  top level, CONCURRENT graphs take the step whole, whatever the
  schedule)."""
  from jaxstreams import _compat
  monkeypatch.setattr(_compat, "MULTI_RESULT_CALLS_RUN_IN_TURN",
                      packed and _compat_jaxlib() < (0, 11))
  fn, args, streams = _program("unequal_scan_towers")

  def step(w1, w2, x):
    return jax.value_and_grad(fn, argnums=(0, 1))(w1, w2, x)

  graphs, plan = _view(step, args, streams, context="jit")
  together = all(p in graphs.parallel_regions() for p in _tower_pairs(plan))
  assert together == (packed or _compat_jaxlib() >= (0, 11)), str(graphs)


def test_a_gradient_taken_outside_runs_the_towers_side_by_side():
  """jax.grad applied to a jaxstreams.jit function inside another jit:
  jax differentiates the one loop, and the backward loop's steps run both
  towers' bodies on their streams too."""
  fn, args, streams = _program("scan_towers")
  graphs, plan = _view(fn, args, streams, context="grad")
  (pair,) = _tower_pairs(plan)
  assert pair in graphs.parallel_regions(), str(graphs)
  assert len(graphs.loops) == 2


def test_the_view_compiles_with_the_jaxstreams_this_process_runs(
    tmp_path, monkeypatch):
  """The view compiles in a child process, which must import the jaxstreams
  this process imported (its FFI handlers included), whatever the working
  directory holds: a source checkout without built libraries there once
  shadowed the installed package, and the loop programs failed in CI."""
  fake = tmp_path / "jaxstreams"
  fake.mkdir()
  (fake / "__init__.py").write_text(
      "raise ImportError('the jaxstreams of the working directory')\n")
  monkeypatch.chdir(tmp_path)
  fn, args, streams = _program("scan_towers")
  graphs, _ = _view(fn, args, streams)
  assert graphs.loops, graphs.summary()


def test_one_child_serves_the_views_and_a_dead_one_is_replaced(monkeypatch):
  """The view's compile child is started once and kept for the next view;
  one that died (XLA's compiler can abort it) is replaced, and another
  environment gets a child of its own. (Nothing read back from the run's
  compile cache: every view here asks the child.)"""
  from jaxstreams.xla._graph_child import CompileChild
  monkeypatch.setattr(kept_compiles, "directory", lambda: None)
  target = jaxstreams.gpu_target("h100")
  lowered = jax.jit(lambda x: x * 2.0 + 1.0).lower(
      *target.abstract(jax.numpy.ones(8)))
  first = jaxstreams.xla_graphs(lowered)
  pid = CompileChild._current.process.pid
  again = jaxstreams.xla_graphs(lowered)
  assert CompileChild._current.process.pid == pid
  assert str(again) == str(first)

  CompileChild._current.process.kill()
  CompileChild._current.process.wait()
  assert str(jaxstreams.xla_graphs(lowered)) == str(first)
  assert CompileChild._current.process.pid != pid

  pid = CompileChild._current.process.pid
  monkeypatch.setenv("JAXSTREAMS_TEST_ANOTHER_ENVIRONMENT", "1")
  assert str(jaxstreams.xla_graphs(lowered)) == str(first)
  assert CompileChild._current.process.pid != pid


def test_a_compile_kept_on_disk_is_read_back_not_compiled_again(monkeypatch,
                                                                 tmp_path):
  """With ``jaxstreams_compile_cache`` set, a program compiled for a target
  is kept, and the next view of it reads it back without asking the child:
  the same view. Another compiler option is another program: compiled."""
  from jaxstreams.xla import _graph_child
  monkeypatch.setattr(kept_compiles, "directory", lambda: tmp_path)
  target = jaxstreams.gpu_target("h100")
  lowered = jax.jit(lambda x: jax.numpy.sin(x) * 3.0).lower(
      *target.abstract(jax.numpy.ones(16)))
  first = jaxstreams.xla_graphs(lowered)
  assert len(list(tmp_path.glob("*.json"))) == 1

  asked = []
  real = _graph_child.CompileChild.request
  monkeypatch.setattr(_graph_child.CompileChild, "request", classmethod(
      lambda cls, *a, **k: asked.append(a) or real(*a, **k)))
  again = jaxstreams.xla_graphs(lowered)
  assert not asked and str(again) == str(first)
  assert again.memory == first.memory

  jaxstreams.xla_graphs(lowered, compiler_options={
      "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"})
  assert len(asked) == 1 and len(list(tmp_path.glob("*.json"))) == 2


def test_a_child_that_dies_is_reported_with_its_exit_status(monkeypatch):
  """A compile child whose output ends before it has exited (XLA writing
  its abort's stack trace, say) is reported by its exit status, not as a
  timeout."""
  from jaxstreams.xla import _graph_child
  monkeypatch.setattr(_graph_child, "CHILD_COMMAND", [
      sys.executable, "-c", "import os, sys, time; sys.stdin.readline(); "
      "os.close(1); time.sleep(1); os._exit(3)"])
  _graph_child.CompileChild.close_current()
  with pytest.raises(_graph_child.ChildFailed, match=r"^exit 3:"):
    _graph_child.CompileChild.request({}, dict(os.environ), timeout=60)
  assert _graph_child.CompileChild._current is None


def test_a_chain_of_loops_stays_one_chain():
  """Loops that need each other's results cannot run side by side: no
  group, and no pair of regions in flight together."""
  def chain(w1, w2, x):
    with jaxstreams.stream(1):
      a = compile_matrix._scan_tower(w1, x)
    with jaxstreams.stream(2):
      b = compile_matrix._scan_tower(w2, a)
    return b.sum()
  _, args, _ = _program("scan_towers")
  graphs, plan = _view(chain, args, 3)
  assert plan.loops == ()
  assert graphs.parallel_regions() == ()
  assert len(graphs.loops) == 2


@pytest.mark.parametrize("name, trips, waits", [
    ("fori_towers", compile_matrix.LAYERS, False),
    ("while_towers", None, True),
])
def test_the_view_reads_loops_with_their_trip_counts(name, trips, waits):
  fn, args, streams = _program(name)
  graphs, _ = _view(fn, args, streams, gpu_lowering="inline")
  assert graphs.loops
  for loop in graphs.loops:
    assert (loop.trip_count, loop.host_waits) == (trips, waits), str(graphs)
  assert "loop " in graphs.summary()


def test_the_view_reads_conditionals():
  """With a current driver XLA puts conditionals into the graph (a CUDA
  conditional node: the GPU picks the branch, the host does not wait)."""
  fn, args, streams = _program("cond_towers")
  graphs, _ = _view(fn, args, streams, gpu_lowering="inline")
  assert len(graphs.conditionals) == 2   # one a tower (the other folds)
  assert all(not c.host_waits for c in graphs.conditionals), str(graphs)


def test_the_view_reads_the_gradient_of_a_checkpointed_scan():
  fn, args, streams = _program("checkpointed_scan_towers")
  graphs, plan = _view(fn, args, streams, context="grad")
  assert len(graphs.loops) >= 2
  (pair,) = _tower_pairs(plan)
  assert pair in graphs.parallel_regions(), str(graphs)


def test_the_target_keeps_library_calls_and_conditionals_in_graphs():
  """The built-in target carries a current driver's versions: XLA keeps
  cuBLAS, cuDNN, custom calls and conditionals in its graph types (a
  deviceless compile would otherwise read version 0.0.0 and drop them), and
  jaxstreams' record of XLA's default types is the installed XLA's."""
  fn, args, streams = _program("constant_towers")
  graphs, _ = _view(fn, args, streams, gpu_lowering="inline")
  assert {"CUBLAS", "CUDNN", "CUSTOM_CALL", "CONDITIONAL"} <= set(
      graphs.command_types)
  assert graphs.command_types == tuple(sorted(gpu.xla_command_buffer_types()))


def test_convolution_branches_run_side_by_side_in_a_graph_by_default():
  """XLA keeps convolutions out of its graphs unless asked: an
  Inception-style step has no graph at all under jax.jit. The default adds
  CONVOLUTION to the graph types (with CONCURRENT graphs) where the plan's
  regions hold convolutions, and the branches run side by side."""
  fn, args, streams = _program("inception")
  plain, _ = _view(fn, args, streams, gpu_lowering="inline")
  assert not plain.graphs and "no CUDA graph" in plain.summary()
  graphs, plan = _view(fn, args, streams)
  assert "CONVOLUTION" in graphs.command_types
  assert graphs.graphs and graphs.parallelism > 1.5, graphs.summary()
  checks = graphs.compare()
  assert checks and any(together for _, _, together in checks), graphs.summary()


def test_the_view_s_plugin_leaves_a_cpu_program_quiet():
  """The CUDA plugin installed without a GPU: a program that imports
  jaxstreams runs on CPU without the plugin's tracebacks; jaxstreams sets
  the platform only where nobody did."""
  import glob
  import os
  import subprocess
  import sys
  if glob.glob("/dev/nvidia*"):
    pytest.skip("this machine has an NVIDIA GPU")
  code = ("import jaxstreams, jax; jax.numpy.ones(2).block_until_ready(); "
          "print(jax.devices()[0].platform, jax.config.jax_platforms)")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  quiet = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, timeout=120)
  assert quiet.returncode == 0, quiet.stderr
  assert quiet.stdout.split() == ["cpu", "cpu"]
  assert "Traceback" not in quiet.stderr and "cuDNN" not in quiet.stderr
  chosen = subprocess.run([sys.executable, "-c", code],
                          env={**env, "JAX_PLATFORMS": "cpu,cuda"},
                          capture_output=True, text=True, timeout=120)
  assert chosen.stdout.split()[-1] == "cpu,cuda"   # the user's choice stands


def test_jaxstreams_imports_where_no_plugin_is_installed():
  """No jax_plugins package at all (no CUDA plugin): importing jaxstreams
  leaves the platforms alone."""
  import os
  import subprocess
  import sys
  code = "\n".join([
      "import importlib.abc, sys",
      "class Hidden(importlib.abc.MetaPathFinder):",
      "  def find_spec(self, name, path=None, target=None):",
      "    if name == 'jax_plugins' or name.startswith('jax_plugins.'):",
      "      raise ModuleNotFoundError(name)",
      "sys.meta_path.insert(0, Hidden())",
      "import jax, jaxstreams",
      "print(jax.config.jax_platforms)"])
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  run = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.split() == ["None"]


@pytest.mark.parametrize("name", [
    "demo", "dlrm", "inception", "mlp_bank", "control",
    pytest.param("dual_encoder", marks=pytest.mark.slow(
        reason="the dual-encoder training step, estimated and compiled "
        "for an H100: 25 to 40 s")),
    "gru_bank", "ode_ensemble"])
def test_the_view_reads_every_program_of_the_suite(name):
  fn, args, streams = _program(name)
  graphs, plan = _view(fn, args, streams)
  assert graphs.graphs or graphs.program.loose_kernels, graphs.summary()
  assert graphs.summary() and graphs.launch_order()
  if plan.loops:   # the suite's towers of loops run side by side
    assert all(p in graphs.parallel_regions() for p in _tower_pairs(plan))
