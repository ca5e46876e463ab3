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
from jax.sharding import Mesh, PartitionSpec as P

import jaxstreams
from programs import ROOT, assert_equal_results, run_example

try:
  from jax import shard_map
except ImportError:   # jax 0.10
  from jax.experimental.shard_map import shard_map

EXAMPLE = str(ROOT / "examples" / "sharded_training.py")
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
  assert re.search(r"^plan: \d+ regions on streams \[0, 1, 2\]$", out, re.M), out
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
      assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err[-4000:]}"
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
  assert "results equal" not in outputs[1]   # only process 0 reports; both check


def test_a_shard_map_body_is_placed_whole_and_the_plan_says_so():
  mesh = Mesh(np.array(jax.devices()), ("d",))

  def body(x):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
    with jaxstreams.stream(2):
      b = jnp.cos(x)
    return jax.lax.psum(a + b, "d")

  def f(x):
    return shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P())(x)

  x = jnp.arange(2.0 * len(jax.devices()))
  plan = jaxstreams.plan(f, streams=3)(x)
  assert plan.streams_used == (0,)
  assert any("its body asks for streams 1, 2; a shard_map body runs as one "
             "computation, so it is placed as a whole" in n for n in plan.notes)
  assert_equal_results(jaxstreams.jit(f, streams=3)(x), jax.jit(f)(x))
