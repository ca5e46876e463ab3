"""Sharded training on JAX's own multi-device runtime: eight CPU devices in
one process, and two processes under ``jax.distributed`` (CPU collectives
between them), each running ``examples/sharded_training.py``, whose towers
are on streams and whose results must equal ``jax.jit``'s bitwise.

Each run is a process of its own, on CPU devices (``JAX_PLATFORMS=cpu``,
also where a GPU is present): the device count and ``jax.distributed`` are
set before JAX starts, which this test process did long ago.
"""

import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxstreams
from programs import ROOT, assert_equal_results, gathered_towers, run_example

try:
  from jax import shard_map
except ImportError:   # jax 0.10
  from jax.experimental.shard_map import shard_map

EXAMPLE = str(ROOT / "examples" / "sharded_training.py")


def needs_devices(n):
  """Skips a test whose mesh needs ``n`` of JAX's default devices: the four
  CPU devices of conftest, where a GPU machine's one GPU is the default."""
  return pytest.mark.skipif(
      len(jax.devices()) < n,
      reason=f"needs {n} devices of JAX's default backend; "
             f"{jax.default_backend()} has {len(jax.devices())}")
STEPS = "--steps=8"


def _loss_line(out):
  match = re.search(r"^loss ([\d.]+) -> ([\d.]+) over 8 steps$", out, re.M)
  assert match, out
  first, last = map(float, match.groups())
  assert last < first, out
  return first, last


def test_eight_cpu_devices_in_one_process():
  out = run_example("sharded_training.py", "--devices=8", STEPS,
                    env={"JAX_PLATFORMS": "cpu"})
  assert "1 process(es), 8 cpu devices, batch sharded" in out, out
  assert re.search(r"^plan: \d+ regions on streams \[0, 1, 2\]$", out,
                   re.M), out
  _loss_line(out)
  assert "results equal jax.jit: bitwise" in out, out


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_under_jax_distributed():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("JAXSTREAMS_STREAMS", None)
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, EXAMPLE, "--devices=4", "--num_processes=2",
       f"--process_id={rank}", f"--coordinator=localhost:{port}", STEPS],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True) for rank in range(2)]
  outputs = []
  try:
    for proc in procs:
      # jax.distributed catches SIGTERM: a stuck process is killed.
      out, err = proc.communicate(timeout=180)
      assert proc.returncode == 0, (
          f"exit {proc.returncode}\n{out}\n{err[-4000:]}")
      outputs.append(out)
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  lead = outputs[0]
  assert "2 process(es), 8 cpu devices, batch sharded" in lead, lead
  _loss_line(lead)
  assert "results equal jax.jit: bitwise" in lead, lead
  assert "results equal" not in outputs[1]   # only process 0 reports; both
                                             # check


def _towers_body(x, w):
  with jaxstreams.stream(1):
    a = jnp.sin(x @ w)
  with jaxstreams.stream(2):
    b = jnp.cos(x) @ jnp.tanh(w)
  return jax.lax.psum((a * b).sum(), "d")


def _mesh():
  return Mesh(np.array(jax.devices()), ("d",))


def _towers(x, w):
  return shard_map(_towers_body, mesh=_mesh(), in_specs=(P("d"), P()),
                   out_specs=P())(x, w)


def _towers_inputs():
  n = 2 * len(jax.devices())
  x = jnp.arange(n * 8.0).reshape(n, 8) / (n * 8)
  w = jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)
  return x, w


def test_a_shard_map_body_gets_a_plan_with_regions_on_its_streams():
  plan = jaxstreams.plan(_towers, streams=3)(*_towers_inputs())
  assert [e.rule for e in plan.equations] == ["inside"]
  assert not plan.is_single_stream
  body = plan.bodies[0]
  assert sorted({r.stream for r in body.regions}) == [0, 1, 2]
  by_name = {e.primitive: e for e in body.equations}
  assert by_name["sin"].stream == 1 and by_name["tanh"].stream == 2
  # The collective, outside every block (psum_invariant from jax 0.10).
  [psum] = [e for e in body.equations if e.primitive.startswith("psum")]
  assert psum.stream == 0
  text = str(plan)
  assert "the body of #0 (shard_map), on every device:" in text
  assert "StreamPlan for _towers/shard_map#0: streams=3" in text


@pytest.mark.parametrize("lowering", ["inline", "streams"])
def test_shard_map_body_regions_give_jax_jit_results_gradients_too(lowering):
  x, w = _towers_inputs()
  grad = jax.grad(_towers, argnums=(0, 1))
  assert_equal_results(
      jaxstreams.jit(_towers, streams=3, gpu_lowering=lowering)(x, w),
      jax.jit(_towers)(x, w))
  assert_equal_results(
      jaxstreams.jit(grad, streams=3, gpu_lowering=lowering)(x, w),
      jax.jit(grad)(x, w))
  plan = jaxstreams.plan(grad, streams=3)(x, w)
  backward = [b for i, b in plan.bodies.items()
              if plan.equations[i].name.startswith("transpose")]
  assert backward and {1, 2} <= {r.stream for r in backward[0].regions}


def test_a_collective_in_a_stream_block_runs_on_the_main_stream():
  def body(x):
    with jaxstreams.stream(1):
      y = jnp.sin(x)
      z = jax.lax.ppermute(y, "d", [(i, (i + 1) % len(jax.devices()))
                                     for i in range(len(jax.devices()))])
    return z * 2

  def f(x):
    return shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"))(x)

  x = jnp.arange(4.0 * len(jax.devices()))
  body_plan = jaxstreams.plan(f, streams=2)(x).bodies[0]
  [ppermute] = [e for e in body_plan.equations if e.primitive == "ppermute"]
  assert (ppermute.stream, ppermute.rule) == (0, "collective")
  assert "XLA:GPU cannot run one inside a stream call" in ppermute.note
  assert [e.stream for e in body_plan.equations
          if e.primitive == "sin"] == [1]
  assert_equal_results(jaxstreams.jit(f, streams=2, gpu_lowering="streams")(x),
                       jax.jit(f)(x))


@needs_devices(2)
def test_a_shard_map_over_some_mesh_axes_is_placed_whole_and_the_plan_says_so():
  """Over part of a mesh the body is not each device's whole program: XLA's
  partitioner still works on it and may put collectives into a region."""
  mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("a", "b"))

  def body(x):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
    with jaxstreams.stream(2):
      b = jnp.cos(x)
    return a + b

  def f(x):
    return shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a"),
                     axis_names={"a"})(x)

  x = jnp.arange(2.0 * len(jax.devices()))
  plan = jaxstreams.plan(f, streams=3)(x)
  assert plan.streams_used == (0,) and not plan.bodies
  assert any("its body asks for streams 1, 2; a shard_map body runs as one "
             "computation, so it is placed as a whole" in n for n in plan.notes)
  assert_equal_results(jaxstreams.jit(f, streams=3)(x), jax.jit(f)(x))


def test_the_shard_map_example_runs_its_towers_on_streams_in_the_body():
  out = run_example("sharded_training.py", "--devices=8", "--shard_map", STEPS,
                    env={"JAX_PLATFORMS": "cpu"})
  assert re.search(r"^shard_map #0 body: \d+ regions on streams \[0, 1, 2\]$",
                   out, re.M), out
  _loss_line(out)
  assert "results equal jax.jit: bitwise" in out, out


@pytest.mark.parametrize("lowering", ["inline", "streams"])
@pytest.mark.parametrize("placed", [True, False])
def test_gathered_towers_give_jax_jit_results(lowering, placed):
  mesh = Mesh(np.array(jax.devices()), ("data",))
  step = gathered_towers(mesh, placed=placed)
  n = len(jax.devices())
  ws = [jnp.linspace(-1, 1, (8 * n) ** 2).reshape(8 * n, 8 * n) / (t + n)
        for t in range(2)]
  x = jnp.linspace(0, 1, 16 * n * 8 * n).reshape(16 * n, 8 * n)
  spread = not placed
  plan = jaxstreams.plan(step, streams=3, spread=spread)(ws, x)
  for body in plan.bodies.values():   # spread: where the estimate pays
    assert {e.primitive: (e.stream, e.rule) for e in body.equations
            }["all_gather"] == (0, "collective")
  assert plan.bodies or spread
  assert_equal_results(
      jaxstreams.jit(step, streams=3, spread=spread,
                     gpu_lowering=lowering)(ws, x),
      jax.jit(step)(ws, x))


def test_a_jit_inside_a_shard_map_body_and_collectives_between_regions():
  @jax.jit
  def inner(x):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
    with jaxstreams.stream(2):
      b = jnp.cos(x)
    return a, b

  def body(x):
    a, b = inner(x)
    gathered = jax.lax.all_gather(a, "d", tiled=True)
    scattered = jax.lax.psum_scatter(b, "d", tiled=True)
    return (gathered.sum() + scattered.sum())[None]

  def f(x):
    return shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"))(x)

  x = jnp.arange(4.0 * len(jax.devices()) ** 2)
  body_plan = jaxstreams.plan(f, streams=3)(x).bodies[0]
  streams = {e.primitive: e.stream for e in body_plan.equations}
  assert (streams["sin"], streams["cos"]) == (1, 2)   # the inner jit's blocks
  assert streams["all_gather"] == streams["reduce_scatter"] == 0
  for lowering in ("inline", "streams"):
    assert_equal_results(
        jaxstreams.jit(f, streams=3, gpu_lowering=lowering)(x), jax.jit(f)(x))


def test_spreading_never_moves_a_collective_and_costs_it_by_its_transfer():
  from jaxstreams.assign import DEFAULT_DEVICE, equation_cost

  def body(x, w):
    a = jnp.tanh(x @ w)          # unplaced: spreading may move these
    b = jnp.sin(x) @ w
    return jax.lax.psum(a * b, "d")

  def f(x, w):
    return shard_map(body, mesh=_mesh(), in_specs=(P("d"), P()),
                     out_specs=P())(x, w)

  x, w = _towers_inputs()
  from jaxstreams import _compat
  from jaxstreams.assign import assign_streams
  from jaxstreams.tag import expose_tags
  [shard_map_eqn] = jax.make_jaxpr(f)(x, w).jaxpr.eqns
  body_program = expose_tags(_compat.shard_map_body(shard_map_eqn))
  placements = assign_streams(body_program, 3, "test", plan_bodies=True)
  [(psum, placement)] = [
      (e, p) for e, p in zip(body_program.jaxpr.eqns, placements)
      if e.primitive.name.startswith("psum")]
  # Rule "collective", not "main": spreading moves only "main" equations.
  assert (placement.stream, placement.rule) == (0, "collective")
  cost = equation_cost(psum)
  assert cost.link_bytes > 0
  assert cost.seconds() >= DEFAULT_DEVICE.collective_s
  assert_equal_results(
      jaxstreams.jit(f, streams=3, spread=True, gpu_lowering="streams")(x, w),
      jax.jit(f)(x, w))


def _data_parallel_step(mesh):
  """examples/sharded_training.py's shard_map step: two MLP towers, each
  (and its gradient) in a stream block, replicated parameters, SGD."""
  def loss_fn(params, x, y):
    out = 0.0
    for t, tower in enumerate(params):
      with jaxstreams.stream(1 + t % 2):
        out = out + jnp.tanh(x @ tower["w"]) @ tower["v"]
    return jnp.mean((out - y) ** 2)

  def local_step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    count = jax.lax.psum(1, "d")
    params = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g / count,
                                    params, grads)
    return params, jax.lax.pmean(loss, "d")

  return shard_map(local_step, mesh=mesh, in_specs=(P(), P("d"), P("d")),
                   out_specs=(P(), P()))


def test_each_towers_gradients_are_reduced_apart_with_jax_jit_results():
  """With stream calls, each collective of a shard_map body that waits for
  stream calls carries the set of those calls as its key for XLA:GPU's
  combiners: one tower's gradient psums share a key, the other tower's have
  another, so XLA never merges them into one all-reduce that waits for both
  towers (tests/test_gpu_compile.py checks the overlap this gives). Keys
  and all, the results are jax.jit's, bitwise."""
  step = _data_parallel_step(_mesh())
  rng = np.random.default_rng(0)
  params = [{"w": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
             "v": jnp.asarray(rng.standard_normal((16, 1)), jnp.float32)}
            for _ in range(2)]
  n = 4 * len(jax.devices())
  x = jnp.asarray(rng.standard_normal((n, 8)), jnp.float32)
  y = jnp.sin(x.sum(axis=1, keepdims=True))
  streamed = jaxstreams.jit(step, streams=3, gpu_lowering="streams")
  text = streamed.lower(params, x, y).as_text()
  # Each psum's all_reduce (its reducer's add carries the key as well).
  keys = re.findall(r'^\s*\}\) \{mhlo\.frontend_attributes = '
                    r'\{combiner_key = "(\w+)"', text, re.M)
  # The loss's pmean waits for the forward regions only; each tower's two
  # gradient psums wait for its own backward region as well.
  assert len(keys) == 5 and len(set(keys)) == 3, keys
  assert sorted(keys.count(k) for k in set(keys)) == [1, 2, 2], keys
  assert_equal_results(streamed(params, x, y), jax.jit(step)(params, x, y))


@needs_devices(4)
def test_shardings_over_an_abstract_mesh_as_jax_jit_takes_them():
  """``in_shardings`` over an abstract mesh (the devices come from
  ``jax.set_mesh`` when traced): lower and trace take them as jax.jit does,
  under one mesh and then another of the same shape."""
  from jax.sharding import NamedSharding
  devices = jax.devices()
  mesh_a, mesh_b = (Mesh(np.array(devices[:2]), ("x",)),
                    Mesh(np.array(devices[2:4]), ("x",)))
  sharding = NamedSharding(mesh_a.abstract_mesh, P("x"))
  x = jax.ShapeDtypeStruct((4,), jnp.float32)

  def double(x):
    with jaxstreams.stream(1):
      y = x * 2
    return y

  texts = {}
  for name, make in (("jax.jit", jax.jit),
                     ("jaxstreams.jit", lambda f, **kw: jaxstreams.jit(
                         f, streams=2, **kw))):
    f = make(double, in_shardings=sharding, out_shardings=sharding)
    for mesh in (mesh_a, mesh_b):
      with jax.set_mesh(mesh):
        texts[name, mesh] = f.trace(x).lower().as_text()
  assert texts["jaxstreams.jit", mesh_b] == texts["jax.jit", mesh_b]
