"""Per-call overhead of jaxstreams.jit over jax.jit for a tiny function.

Both wrappers dispatch a compiled executable; what is measured is the Python
and dispatch cost around it. Method: compile and warm up, then time batches
of calls (each batch ends with block_until_ready on the last result),
alternating the wrappers batch by batch so machine noise hits both alike, and
report the median time per call and the ratio to jax.jit.

The first call is reported apart: trace, plan and compile of a function with
two regions, and on a GPU the timing of its candidate ways
(``jaxstreams.lower.autotune``, with the on-disk cache off so that it runs):
the cost a user pays once per function, against ``jax.jit``'s first call.

  python benchmarks/jit_overhead.py [--calls 2000] [--batches 31] [--out DIR]
"""

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

import jaxstreams


def tiny(x):
  return x + 1


def tiny_with_region(x):
  with jaxstreams.stream(1):
    y = x * 2
  return y + 1


def two_regions():
  """A fresh function with two independent regions (fresh: nothing cached)."""
  def f(x, w):
    with jaxstreams.stream(1):
      a = jnp.tanh(x @ w)
    with jaxstreams.stream(2):
      b = jnp.sin(x @ w.T)
    return (a * b).sum()
  return f


def first_call_seconds(make_jit, x, w) -> float:
  fn = make_jit(two_regions())
  start = time.perf_counter()
  jax.block_until_ready(fn(x, w))
  return time.perf_counter() - start


def time_batch(fn, x, calls):
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(x)
  out.block_until_ready()
  return (time.perf_counter() - start) / calls


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=2000)
  parser.add_argument("--batches", type=int, default=31)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__),
                                                    "results"))
  args = parser.parse_args()

  x = jnp.float32(1.0)
  candidates = {
      "jax.jit": jax.jit(tiny),
      "jaxstreams.jit(streams=1)": jaxstreams.jit(tiny, streams=1),
      "jaxstreams.jit(streams from option)": jaxstreams.jit(tiny),
      "jax.jit, two-part function": jax.jit(tiny_with_region),
      "jaxstreams.jit(streams=2), region": jaxstreams.jit(tiny_with_region,
                                                         streams=2),
  }
  for fn in candidates.values():
    for _ in range(200):
      fn(x).block_until_ready()
  samples = {name: [] for name in candidates}
  for _ in range(args.batches):
    for name, fn in candidates.items():
      samples[name].append(time_batch(fn, x, args.calls))
  medians = {name: statistics.median(s) for name, s in samples.items()}
  jaxstreams.config.update("jaxstreams_autotune_cache", "none")
  xm, wm = jnp.ones((256, 256)), jnp.ones((256, 256))
  first_jax, first_ours = [], []
  for _ in range(3):
    first_jax.append(first_call_seconds(jax.jit, xm, wm))
    first_ours.append(first_call_seconds(
        lambda f: jaxstreams.jit(f, streams=3), xm, wm))
  first = {"jax.jit": statistics.median(first_jax),
           "jaxstreams.jit(streams=3), two regions": statistics.median(first_ours)}
  baselines = {"jaxstreams.jit(streams=1)": "jax.jit",
               "jaxstreams.jit(streams from option)": "jax.jit",
               "jaxstreams.jit(streams=2), region": "jax.jit, two-part function"}
  device = jax.devices()[0]
  result = {
      "benchmark": "jit_overhead", "device": device.device_kind,
      "platform": device.platform, "jax": jax.__version__,
      "machine": f"{platform.machine()} {os.cpu_count()} cores",
      "calls_per_batch": args.calls, "batches": args.batches,
      "median_us_per_call": {k: v * 1e6 for k, v in medians.items()},
      "ratio_to_baseline": {k: medians[k] / medians[b] for k, b in baselines.items()},
      "first_call_s": first,
      "first_call_ratio": first["jaxstreams.jit(streams=3), two regions"]
                          / first["jax.jit"],
  }
  print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
  for name, seconds in medians.items():
    line = f"  {name:40s} {seconds * 1e6:8.2f} us/call"
    if name in baselines:
      line += f"   x{medians[name] / medians[baselines[name]]:.3f} vs {baselines[name]}"
    print(line)
  print(f"  first call, two regions: jax.jit {first['jax.jit'] * 1e3:.1f} ms, "
        f"jaxstreams.jit {first['jaxstreams.jit(streams=3), two regions'] * 1e3:.1f}"
        f" ms (x{result['first_call_ratio']:.2f}; on a GPU this includes "
        "timing the candidate ways)")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"jit_overhead_{device.platform}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"saved {path}")


if __name__ == "__main__":
  main()
