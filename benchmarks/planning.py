"""Planning time for programs of 100, 1,000 and 10,000 equations.

What is timed is the pipeline after tracing (tag exposure, assignment with
spreading on, partitioning, the estimated schedule: what a
``jaxstreams.jit`` trace runs before lowering): ``jaxstreams._pipeline.
plan_program`` on a traced jaxpr. The user's ``StreamPlan`` report (value
names, source lines), made only when asked for, is not timed. The
programs are ``branches`` independent chains of small matmuls and
elementwise ops joined at the end, a third of their ops in stream() blocks.
Reported: median of repetitions, milliseconds per 1,000 equations, and the
growth exponent between sizes (1.0 is linear; n log n is a little above).
Goal: under 10 ms per 1,000 equations.

  python benchmarks/planning.py [--sizes 100 1000 10000] [--reps 5]
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jaxstreams
from jaxstreams import _pipeline
from jaxstreams._pipeline import PlanOptions
from jaxstreams.partition import report

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def make_program(target_eqns: int, branches: int = 8):
  """A traced program with about ``target_eqns`` equations."""
  per_branch = max(1, target_eqns // (branches * 2))

  def f(x, w):
    outs = []
    for b in range(branches):
      h = x
      for k in range(per_branch):
        if k % 3 == 0:
          with jaxstreams.stream(1 + b % 3):
            h = jnp.tanh(h @ w)
        else:
          h = jnp.tanh(h @ w)
      outs.append(h)
    return sum(outs)

  x = jax.ShapeDtypeStruct((8, 32), jnp.float32)
  w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
  return jax.make_jaxpr(f)(x, w)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=int, nargs="+",
                      default=[100, 1000, 10000])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--out", default=None, help=_common.OUT_HELP)
  args = parser.parse_args()

  rows = []
  for size in args.sizes:
    closed = make_program(size)
    n = len(closed.jaxpr.eqns)
    times = []
    for _ in range(args.reps):
      start = time.perf_counter()
      partitioned = _pipeline.plan_program(closed, 4, "benchmark", "program",
                                           PlanOptions(spread=True))
      times.append(time.perf_counter() - start)
    plan = report(partitioned)   # the user's report, made only on request
    median = statistics.median(times)
    rows.append({"equations": n, "median_ms": median * 1e3,
                 "ms_per_1000_equations": median * 1e3 / n * 1000,
                 "regions": len(plan.regions),
                 "streams_used": list(plan.streams_used)})
    print(f"{n:6d} equations: {median * 1e3:9.2f} ms  "
          f"({median * 1e6 / n:7.1f} us per equation, "
          f"{median * 1e3 / n * 1000:6.2f} ms per 1,000), "
          f"{len(plan.regions)} regions")
  for a, b in zip(rows, rows[1:]):
    exponent = (math.log(b["median_ms"] / a["median_ms"])
                / math.log(b["equations"] / a["equations"]))
    b["growth_exponent_from_previous"] = exponent
    print(f"  growth {a['equations']} -> {b['equations']}: n^{exponent:.2f}")
  result = {"benchmark": "planning", "jax": jax.__version__,
            "machine": f"{platform.processor() or platform.machine()}, "
                       f"{os.cpu_count()} cores",
            "rows": rows}
  path = os.path.join(_common.out_folder(args.out),
                      f"planning_{jax.default_backend()}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"saved {path}")


if __name__ == "__main__":
  main()
