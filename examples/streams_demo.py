"""jaxstreams at work: a two-tower training step placed on three streams,
and a dual encoder whose towers scan over their layers.

Prints the stream plan and the way a GPU runs it; the CUDA graphs XLA:GPU
builds for the step (compiled for an H100 on this machine, when the CUDA
plugin is installed) as ``jax.jit`` builds it, as jaxstreams runs it by
default, and with each region a call on its stream: which regions can run
side by side in what the GPU launches; checks the results against jax.jit;
and, on a GPU, times jax.jit, jaxstreams.jit as it runs by default (its
first call timed the candidate ways) and with each way forced.

Then the case XLA's own concurrency does not reach: two towers that are
``lax.scan`` loops over stacked layers (how most JAX models write deep
stacks). XLA runs a loop outside its CUDA graphs, kernel by kernel, so
under ``jax.jit`` the towers run one after the other, with XLA's
CONCURRENT graph mode as without; jaxstreams runs the two loops as one
whose every step runs both towers' layers, each on its stream. The demo
shows what an H100 would launch each way, and checks the results.

  python examples/streams_demo.py [--towers 2] [--width 512] [--batch 8]
                                  [--scan-depth 6]
"""

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxstreams
from jaxstreams.lower import gpu


def make_step(towers):
  def loss(params, x, y):
    outs = []
    for i, w in enumerate(params["towers"]):
      with jaxstreams.stream(1 + i):   # tower i on stream i+1
        h = x
        for layer in w:
          h = jnp.tanh(h @ layer)
        outs.append(h)
    pred = sum(outs) @ params["head"]
    return jnp.mean((pred - y) ** 2)

  def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    new = jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)
    return new, value
  return step


def init(towers, width, depth, key):
  keys = jax.random.split(key, towers * depth + 1)
  scale = width ** -0.5
  tower_ws = [[jax.random.normal(keys[t * depth + d], (width, width)) * scale
               for d in range(depth)] for t in range(towers)]
  return {"towers": tower_ws,
          "head": jax.random.normal(keys[-1], (width, 1)) * scale}


def median_time(fn, args, reps=30):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def show_gpu_graphs(programs, plan, args):
  """The CUDA graphs XLA:GPU builds for each program, compiled for an H100
  in a child process (no GPU needed): how many kernels, the longest chain
  of them, and which of the plan's regions can run side by side."""
  try:
    from jaxstreams.xla.target import _check_plugin, _check_ptxas
    _check_plugin()
    _check_ptxas()
  except jaxstreams.GpuTargetError as error:
    text = programs["stream calls"].trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r'call @\S+.*_xla_stream_annotation = "(\d+)"', text)
    print(f"lowered for CUDA: {len(calls)} region calls, on streams "
          f"{sorted({int(c) for c in calls})}. To see the CUDA graphs an "
          f"H100 would launch: {error}\n")
    return
  print("the CUDA graphs an H100 launches for the step (compiled without one; "
        "parallelism = kernels / longest chain of them):")
  for name, fn in programs.items():
    lowered = fn.trace(*args).lower(lowering_platforms=("cuda",))
    graphs = jaxstreams.xla_graphs(lowered, plan=plan)
    pairs = graphs.compare(plan)
    print(f"  {name:36s} {graphs.kernels:3d} kernels, parallelism "
          f"{graphs.parallelism:.2f}, {sum(t for _, _, t in pairs)} of "
          f"{len(pairs)} pairs of tower regions side by side")
  print()


def scanned_dual_encoder_step(params, x, y):
  """A dual encoder's training step: two towers of residual layers, each
  one ``lax.scan`` over its stacked weights, on streams 1 and 2, joined by
  a contrastive loss; plain SGD."""
  def tower(ws, h):
    def layer(h, w):
      return h + jnp.tanh(h @ w), None
    h, _ = jax.lax.scan(layer, h, ws)
    return h / jnp.linalg.norm(h, axis=-1, keepdims=True)

  def loss(params):
    with jaxstreams.stream(1):
      image = tower(params["image"], x)
    with jaxstreams.stream(2):
      text = tower(params["text"], y)
    logits = 10.0 * image @ text.T
    return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(logits)))

  value, grads = jax.value_and_grad(loss)(params)
  return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), value


def show_scanned_towers(args, depth, batch):
  """The scanned dual encoder: the loops an H100 runs, and whether the
  towers' layers are in flight together, under jax.jit, under jax.jit
  with CONCURRENT graphs, and as jaxstreams runs it by default."""
  width = min(args.width, 256)
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  params = {name: jax.random.normal(k, (depth, width, width)) * width ** -0.5
            for name, k in zip(("image", "text"), keys[:2])}
  x = jax.random.normal(keys[2], (batch, width))
  y = jax.random.normal(keys[3], (batch, width))
  step_args = (params, x, y)
  print(f"a dual encoder whose towers are lax.scan loops over {depth} layers "
        f"(width {width}), its training step:")
  default = jaxstreams.jit(scanned_dual_encoder_step, streams=3)
  plan = default.plan(*step_args)
  print(f"  the plan runs {len(plan.loops)} pairs of loops as one loop each "
        f"(forward and backward), on a GPU {plan.gpu_lowering!r}")
  ways = {"jax.jit": "inline", "jax.jit with CONCURRENT graphs": "concurrent",
          "jaxstreams.jit, default": None}
  try:
    from jaxstreams.xla.target import _check_plugin, _check_ptxas
    _check_plugin()
    _check_ptxas()
  except jaxstreams.GpuTargetError as error:
    print(f"  to see what an H100 would launch: {error}")
    ways = {}
  for name, way in ways.items():
    fn = jaxstreams.jit(scanned_dual_encoder_step, streams=3, gpu_lowering=way)
    lowered = fn.trace(*step_args).lower(lowering_platforms=("cuda",))
    graphs = jaxstreams.xla_graphs(lowered, plan=plan)
    together = set(graphs.parallel_regions())
    pairs = [tuple(g.regions) for g in plan.loops]
    side = sum(p in together for p in pairs)
    print(f"  {name:32s} {len(graphs.loops)} loops; towers' layers in flight "
          f"together in {side} of {len(pairs)} passes"
          + ("" if side else ": one tower's loop after the other's"))
  same = all(np.array_equal(a, b) for a, b in zip(
      jax.tree_util.tree_leaves(default(*step_args)),
      jax.tree_util.tree_leaves(
          jax.jit(scanned_dual_encoder_step)(*step_args))))
  print(f"  results equal jax.jit: {'bitwise' if same else 'NO'}")
  if jax.default_backend() == "gpu":
    concurrent = jax.jit(scanned_dual_encoder_step).lower(*step_args).compile(
        compiler_options={"xla_gpu_command_buffer_scheduling_mode":
                          "CONCURRENT"})
    times = {"jax.jit": median_time(jax.jit(scanned_dual_encoder_step),
                                    step_args),
             "jax.jit with CONCURRENT graphs": median_time(concurrent,
                                                           step_args),
             "jaxstreams.jit, default": median_time(default, step_args)}
    for name, t in times.items():
      print(f"  step time: {name:32s} {t * 1e3:.3f} ms, "
            f"x{times['jax.jit'] / t:.2f} of jax.jit")
  print()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--towers", type=int, default=2)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--scan-depth", type=int, default=6,
                      help="layers of each scanned tower (0: leave it out)")
  args = parser.parse_args()

  step = make_step(args.towers)
  params = init(args.towers, args.width, args.depth, jax.random.PRNGKey(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (args.batch, args.width))
  y = jax.random.normal(jax.random.PRNGKey(2), (args.batch, 1))

  streams = args.towers + 1
  default = jaxstreams.jit(step, streams=streams)
  calls = jaxstreams.jit(step, streams=streams, gpu_lowering="streams")
  plain = jax.jit(step)

  plan = default.plan(params, x, y)
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), "
        f"jax {jax.__version__}\n")
  summary = str(plan).split("\nequations (")[0]
  print(summary, "\n")

  show_gpu_graphs({"jax.jit": plain, "jaxstreams.jit, default": default,
                   "stream calls (gpu_lowering=streams)": calls},
                  plan, (params, x, y))

  new_fast, loss_fast = default(params, x, y)
  new_plain, loss_plain = plain(params, x, y)
  same = all(np.array_equal(a, b) for a, b in zip(
      jax.tree_util.tree_leaves((new_fast, loss_fast)),
      jax.tree_util.tree_leaves((new_plain, loss_plain))))
  close = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(
      jax.tree_util.tree_leaves((new_fast, loss_fast)),
      jax.tree_util.tree_leaves((new_plain, loss_plain))))
  print(f"loss {float(loss_fast):.6f}; results equal jax.jit: "
        f"{'bitwise' if same else 'to rounding' if close else 'NO'}")

  pairs = list(zip(jax.tree_util.tree_leaves(calls(params, x, y)),
                   jax.tree_util.tree_leaves((new_plain, loss_plain))))
  same = all(np.array_equal(a, b) for a, b in pairs)
  # On a GPU the regions fuse and tile their (TF32) matmuls differently.
  close = all(np.allclose(a, b, rtol=2e-2, atol=2e-2) for a, b in pairs)
  print(f"with stream calls, results equal jax.jit: "
        f"{'bitwise' if same else 'to rounding' if close else 'NO'}")

  print()
  if args.scan_depth:
    show_scanned_towers(args, args.scan_depth, args.batch)

  if jax.default_backend() == "gpu":
    ways = {"jax.jit": plain,
            f"jaxstreams.jit, default "
            f"({default.plan(params, x, y).gpu_lowering})": default}
    for way in gpu.WAYS:
      ways[f"jaxstreams.jit, {way}"] = jaxstreams.jit(
          step, streams=streams, gpu_lowering=way)
    times = {name: median_time(fn, (params, x, y)) for name, fn in ways.items()}
    for name, t in times.items():
      print(f"step time: {name:44s} {t * 1e3:.3f} ms, "
            f"x{times['jax.jit'] / t:.2f} of jax.jit")
  else:
    print("no GPU here: XLA:CPU has one stream, so every way is the program "
          "jax.jit builds and there is no speedup to show; run on a GPU for "
          "timings.")


if __name__ == "__main__":
  main()
