"""Per-call overhead of jaxstreams.jit over jax.jit for a tiny function.

Both wrappers dispatch a compiled executable; what is measured is the Python
and dispatch cost around it. Method: compile and warm up, then time batches
of calls (each batch ends with block_until_ready on the last result),
alternating the wrappers batch by batch so machine noise hits both alike, and
report the median time per call and the ratio to jax.jit.

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
  }
  print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
  for name, seconds in medians.items():
    line = f"  {name:40s} {seconds * 1e6:8.2f} us/call"
    if name in baselines:
      line += f"   x{medians[name] / medians[baselines[name]]:.3f} vs {baselines[name]}"
    print(line)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"jit_overhead_{device.platform}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"saved {path}")


if __name__ == "__main__":
  main()
