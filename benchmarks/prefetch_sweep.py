"""Never slower than doing without: prefetch and staged against the plain
loop, for steps from 0.1 ms to 10 ms, with and without a per-step read.

The step is a jitted function whose time is calibrated (a chain of small
matmuls repeated with ``lax.fori_loop``) to about 0.1, 0.3, 1, 3 and 10 ms;
the producer is free (host numpy batches made in advance), so what is
measured is the cost of each path's hand-off itself, where prefetching has
nothing to hide. Three loops, in the same run, alternating:

* ``plain``: ``for b in data: out = step(w, b)``;
* ``prefetch``: ``for b in jaxstreams.prefetch(data): out = step(w, b)``;
* ``staged``: ``jaxstreams.staged(step, data=data)`` with the batch's
  preprocessing in ``jaxstreams.stage(...)``, called once per batch.

"read" means the loop reads each step's result (``float(loss)``), so the
host waits for the device every step (the usual loop that logs its loss);
"no read" reads only the last result. Printed: time per step and the ratios
prefetch / plain and staged / plain (steps per second; > 1 is faster).
Saves JSON and text under benchmarks/results/.

  python benchmarks/prefetch_sweep.py [--quick] [--steps N] [--repeats R]
"""

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxstreams

STEP_MS = (0.1, 0.3, 1.0, 3.0, 10.0)


def make_step(iters):
  def step(w, batch):
    x = jaxstreams.stage(jnp.tanh(batch * 0.5))    # data-only preprocessing

    def body(_, h):
      return jnp.tanh(h @ w)

    h = jax.lax.fori_loop(0, iters, body, x)
    return jnp.mean(h * h)
  return step


def _ms_per_step(w, batch, iters, n=30):
  f = jax.jit(make_step(iters))
  f(w, batch).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(n):
    f(w, batch).block_until_ready()
  return (time.perf_counter() - t0) / n * 1e3


def calibrate(w, batch, target_ms):
  """Iterations of the loop body giving a step of about ``target_ms``: the
  fixed cost (1 iteration) and the cost per iteration (256), linearly."""
  fixed = _ms_per_step(w, batch, 1)
  per_iter = max((_ms_per_step(w, batch, 256, n=10) - fixed) / 255, 1e-6)
  return max(1, round((target_ms - fixed) / per_iter))


def run_plain(step, w, data, read):
  out = None
  for b in data:
    out = step(w, b)
    if read:
      float(out)
  return float(out)


def run_prefetch(step, w, data, read):
  """The plain loop, fed by ``jaxstreams.prefetch`` instead of the list."""
  with jaxstreams.prefetch(data) as it:
    return run_plain(step, w, it, read)


def run_staged(step, w, data, read):
  out = None
  with jaxstreams.staged(step, data=data) as runner:
    for _ in range(len(data)):
      out = runner(w)
      if read:
        float(out)
  return float(out)


LOOPS = {"plain": run_plain, "prefetch": run_prefetch, "staged": run_staged}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--quick", action="store_true",
                      help="150 steps (30 for 10 ms steps) x 3 repeats")
  parser.add_argument("--quiet", action="store_true",
                      help="record that the machine was otherwise idle")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__),
                                                    "results"))
  args = parser.parse_args()
  if args.quick:
    args.steps, args.repeats = 150, 3

  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32)
  batch_shape = (16, 32)
  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({device.platform}), jax "
        f"{jax.__version__}, {os.cpu_count()} cores; free producer; "
        f"{args.repeats} repeats, median")
  print(f"{'step':>8} {'read':>6} {'plain us':>9} {'prefetch':>9} "
        f"{'staged':>9}   prefetch/plain staged/plain")
  rows = []
  lines = []
  for target in STEP_MS:
    iters = calibrate(w, jnp.ones(batch_shape), target)
    step = make_step(iters)
    jitted = jax.jit(step)
    steps = args.steps if target < 10 else max(30, args.steps // 5)
    data = [rng.standard_normal(batch_shape).astype(np.float32)
            for _ in range(steps)]
    for read in (True, False):
      for name, loop in LOOPS.items():       # compile and warm each path
        loop(jitted, w, data[:8], read)
      times = {name: [] for name in LOOPS}
      results = {}
      for repeat in range(args.repeats):
        order = list(LOOPS) if repeat % 2 == 0 else list(LOOPS)[::-1]
        for name in order:
          t0 = time.perf_counter()
          results[name] = LOOPS[name](jitted, w, data, read)
          times[name].append((time.perf_counter() - t0) / steps)
      assert results["plain"] == results["prefetch"] == results["staged"], \
          results
      med = {name: statistics.median(v) for name, v in times.items()}
      row = {"step_ms_target": target, "iters": iters, "read_every_step": read,
             "steps": steps, "seconds_per_step": med,
             "all_seconds_per_step": times,
             "speed_vs_plain": {name: med["plain"] / med[name]
                                for name in ("prefetch", "staged")}}
      rows.append(row)
      line = (f"{target:>6.1f}ms {'yes' if read else 'no':>6} "
              f"{med['plain'] * 1e6:>9.0f} {med['prefetch'] * 1e6:>9.0f} "
              f"{med['staged'] * 1e6:>9.0f}   "
              f"{row['speed_vs_plain']['prefetch']:>13.3f}x "
              f"{row['speed_vs_plain']['staged']:>11.3f}x")
      print(line, flush=True)
      lines.append(line)

  result = {"benchmark": "prefetch_sweep", "device": device.device_kind,
            "platform": device.platform, "jax": jax.__version__,
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "quiet_machine": args.quiet, "steps": args.steps,
            "repeats": args.repeats, "rows": rows}
  os.makedirs(args.out, exist_ok=True)
  base = os.path.join(args.out, f"prefetch_sweep_{device.platform}")
  with open(base + ".json", "w") as f:
    json.dump(result, f, indent=2)
  with open(base + ".txt", "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"saved {base}.json and .txt")


if __name__ == "__main__":
  main()
