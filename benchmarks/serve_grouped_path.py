"""What a grouped request costs on the host: serve(mode="grouped") against
threads calling jax.jit, on whatever jaxstreams is first on PYTHONPATH.

On XLA:CPU nothing runs side by side (one stream), so the grouped server's
throughput over jax.jit's measures what its path costs beyond the work:
admission, batching, the batch program's lookup and launch, the hand-offs
between threads and each request's completion. Run it on two checkouts in
alternation to compare their paths (one line each)::

  for i in 1 2 3; do
    PYTHONPATH=/old/checkout python benchmarks/serve_grouped_path.py before
    PYTHONPATH=. python benchmarks/serve_grouped_path.py after
  done

Each line: the label, the paired ratio (median over ``ROUNDS`` rounds of
grouped throughput over jax.jit's in the same round) at 1, 4 and 16 client
threads, and the grouped server's batch sizes. The batch-1 MLP of
benchmarks/serve.py, groups=4.
"""

import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxstreams  # noqa: E402
import serve_models  # noqa: E402
from serve import run_clients  # noqa: E402

ROUNDS = 6
SECONDS = 0.3


def main():
  label = sys.argv[1] if len(sys.argv) > 1 else "grouped"
  model = serve_models.mlp()
  fn = serve_models.jax_function(model)
  inputs = [tuple(jnp.asarray(a) for a in model.inputs(i)) for i in range(64)]
  jitted = jax.jit(fn)

  def call_jit(*xs):
    return jitted(*xs).block_until_ready()

  server = jaxstreams.serve(fn, groups=4, mode="grouped", queue_size=4096)
  for _ in range(5):                   # every batch size compiled
    run_clients(server, inputs, 16, 0.2)
  ratios = {}
  for threads in (1, 4, 16):
    per_round = []
    for r in range(ROUNDS):
      order = [("jit", call_jit), ("grouped", server)]
      rates = {}
      for name, call in (order if r % 2 == 0 else order[::-1]):
        latencies, wall = run_clients(call, inputs, threads, SECONDS)
        rates[name] = len(latencies) / wall
      per_round.append(rates["grouped"] / rates["jit"])
    ratios[threads] = round(statistics.median(per_round), 3)
  print(label, json.dumps(ratios), server.stats().batch_sizes,
        f"load {os.getloadavg()[0]:.1f}", flush=True)
  server.close()


if __name__ == "__main__":
  main()
