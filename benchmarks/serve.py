"""Serving small requests: jaxstreams.serve against threads calling jax.jit.

A small MLP at batch 1 (weights closed over, as a served model's are) is
called by 1, 4, 16 and 64 client threads. Each client sends one request,
waits for its result (block_until_ready), and sends the next, for a fixed
time. Two ways of serving are measured in the same run:

* ``jax.jit``: every client thread calls ``jax.jit(mlp)(x)`` itself, so
  requests run one after another on the device's one stream;
* ``serve``: every client calls a ``jaxstreams.serve(mlp, groups=G)`` server
  in its default ``mode="auto"``: on XLA:CPU (one stream) each request runs
  as ``jax.jit`` in its caller's thread; with streams, requests that arrive
  together run as one execution, each on its own stream group;
* ``grouped`` (for reference): the same server forced to ``mode="grouped"``.

For each thread count the modes alternate (in reversed order every other
repeat) ``--repeats`` times (so machine
drift hits both) and the samples are pooled. Reported: throughput
(requests/s), p50 and p99 latency (submit to result), the ratios serve /
jax.jit, and serve's batch sizes. Saves JSON under benchmarks/results/.

  python benchmarks/serve.py [--quick] [--seconds 1.5] [--repeats 2]
      [--groups 4] [--threads 1,4,16,64] [--out DIR]

``--quick`` (0.4 s x 2 per point) finishes in about a minute.

On a CPU there are no streams to gain (XLA:CPU has one), so what this shows
there is the cost or gain of the batching path itself; on a GPU it also
shows what running requests on separate streams buys.
"""

import argparse
import json
import os
import platform
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxstreams


def make_mlp(features=64, width=256, depth=3, classes=16, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), depth + 1)
  sizes = [features] + [width] * depth
  layers = [(jax.random.normal(k, (i, o), jnp.float32) / np.sqrt(i),
             jnp.zeros((o,), jnp.float32))
            for k, i, o in zip(keys, sizes[:-1], sizes[1:])]
  head = jax.random.normal(keys[-1], (width, classes), jnp.float32) / np.sqrt(width)

  def mlp(x):
    for w, b in layers:
      x = jax.nn.relu(x @ w + b)
    return jax.nn.log_softmax(x @ head)

  return mlp, features


def run_clients(call, inputs, threads, seconds):
  """Clients call ``call(x)`` in a loop for ``seconds``; returns latencies
  (seconds, all clients pooled) and the wall time."""
  latencies = [[] for _ in range(threads)]
  start_barrier = threading.Barrier(threads + 1)
  stop_at = [0.0]

  def client(t):
    x = inputs[t % len(inputs)]
    mine = latencies[t]
    start_barrier.wait()
    while True:
      t0 = time.perf_counter()
      if t0 >= stop_at[0]:
        return
      call(x)
      mine.append(time.perf_counter() - t0)

  workers = [threading.Thread(target=client, args=(t,)) for t in range(threads)]
  for w in workers:
    w.start()
  begin = time.perf_counter()
  stop_at[0] = begin + seconds
  start_barrier.wait()
  for w in workers:
    w.join()
  wall = time.perf_counter() - begin
  return [v for per in latencies for v in per], wall


def summarize(latencies, wall):
  lat = np.asarray(latencies) * 1e6
  return {"requests": int(lat.size), "throughput_rps": lat.size / wall,
          "p50_us": float(np.percentile(lat, 50)),
          "p99_us": float(np.percentile(lat, 99))}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seconds", type=float, default=1.5,
                      help="client time per measurement")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--groups", type=int, default=4)
  parser.add_argument("--threads", default="1,4,16,64")
  parser.add_argument("--quiet", action="store_true",
                      help="record that the machine was otherwise idle")
  parser.add_argument("--quick", action="store_true",
                      help="0.4 s x 2 repeats per point")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__),
                                                    "results"))
  args = parser.parse_args()
  thread_counts = [int(t) for t in args.threads.split(",")]
  if args.quick:
    args.seconds, args.repeats = 0.4, 2

  mlp, features = make_mlp()
  inputs = [jax.random.normal(jax.random.PRNGKey(100 + i), (1, features))
            for i in range(64)]
  jitted = jax.jit(mlp)

  def call_jit(x):
    return jitted(x).block_until_ready()

  server = jaxstreams.serve(mlp, groups=args.groups, queue_size=4096)
  grouped = jaxstreams.serve(mlp, groups=args.groups, queue_size=4096,
                             mode="grouped")
  # Same results, and every batch size compiled before timing.
  for x in inputs[:4]:
    assert np.array_equal(server(x), jitted(x))
    assert np.array_equal(grouped(x), jitted(x))
  run_clients(server, inputs, 4, 0.2)
  run_clients(grouped, inputs, 4 * args.groups, 0.5)
  run_clients(call_jit, inputs, 4, 0.2)
  before = grouped.stats()
  modes = (("jax.jit", call_jit), ("serve", server), ("grouped", grouped))

  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({device.platform}), jax "
        f"{jax.__version__}, {os.cpu_count()} cores; MLP 64-256x3-16 at batch "
        f"1; serve groups={args.groups}, mode {server.mode} "
        f"({server.stats().mode_reason}); {args.seconds}s x {args.repeats} "
        "per point")
  header = (f"{'threads':>7}  {'mode':<8} {'req/s':>10} {'p50 us':>9} "
            f"{'p99 us':>9}")
  print(header)
  rows = {}
  for threads in thread_counts:
    samples = {mode: ([], 0.0) for mode, _ in modes}
    for repeat in range(args.repeats):
      # Alternate the order, so that no mode always runs first (or last).
      for mode, call in (modes if repeat % 2 == 0 else modes[::-1]):
        lat, wall = run_clients(call, inputs, threads, args.seconds)
        prev_lat, prev_wall = samples[mode]
        samples[mode] = (prev_lat + lat, prev_wall + wall)
    row = {mode: summarize(*s) for mode, s in samples.items()}
    row["ratio_serve_to_jit"] = {
        "throughput": row["serve"]["throughput_rps"] / row["jax.jit"]["throughput_rps"],
        "p50": row["serve"]["p50_us"] / row["jax.jit"]["p50_us"],
        "p99": row["serve"]["p99_us"] / row["jax.jit"]["p99_us"]}
    row["ratio_grouped_to_jit"] = {
        "throughput": row["grouped"]["throughput_rps"] / row["jax.jit"]["throughput_rps"],
        "p50": row["grouped"]["p50_us"] / row["jax.jit"]["p50_us"]}
    rows[str(threads)] = row
    for mode, _ in modes:
      r = row[mode]
      print(f"{threads:>7}  {mode:<8} {r['throughput_rps']:>10.0f} "
            f"{r['p50_us']:>9.1f} {r['p99_us']:>9.1f}")
    q = row["ratio_serve_to_jit"]
    print(f"{'':>7}  serve/jit: throughput {q['throughput']:.2f}x, p50 "
          f"{q['p50']:.2f}x, p99 {q['p99']:.2f}x")
    g = row["ratio_grouped_to_jit"]
    print(f"{'':>7}  grouped/jit: throughput {g['throughput']:.2f}x, p50 "
          f"{g['p50']:.2f}x")
  after = grouped.stats()
  serve_stats = server.stats()
  server.close()
  grouped.close()
  batch_sizes = {k: v - before.batch_sizes.get(k, 0)
                 for k, v in after.batch_sizes.items()}
  print(f"grouped batch sizes (requests per execution: executions): "
        f"{batch_sizes}; serve ran {serve_stats.direct} of "
        f"{serve_stats.requests} requests directly")

  result = {
      "benchmark": "serve", "device": device.device_kind,
      "platform": device.platform, "jax": jax.__version__,
      "machine": f"{platform.machine()} {os.cpu_count()} cores",
      "model": "MLP 64-256-256-256-16, batch 1, weights closed over",
      "groups": args.groups, "serve_mode": serve_stats.mode,
      "serve_mode_reason": serve_stats.mode_reason,
      "seconds_per_point": args.seconds,
      "repeats": args.repeats, "results_by_threads": rows,
      "grouped_batch_sizes": batch_sizes,
      "note": "noisy unless the machine was quiet; see quiet_machine",
      "quiet_machine": args.quiet,
  }
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"serve_{device.platform}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"saved {path}")


if __name__ == "__main__":
  main()
