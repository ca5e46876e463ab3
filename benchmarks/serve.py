"""Serving small requests: jaxstreams.serve against threads calling jax.jit.

A small MLP at batch 1 (weights closed over, as a served model's are) is
called by 1, 4, 16 and 64 client threads. Each client sends one request,
waits for its result (block_until_ready) and sends the next, for a fixed
time. Three ways of serving, measured in the same run:

* ``jax.jit`` (the baseline): every client thread calls ``jax.jit(mlp)(x)``
  itself;
* ``serve``: every client calls ``jaxstreams.serve(mlp, groups=G)`` in its
  default ``mode="by_platform"``: each request runs as ``jax.jit`` in its
  caller's thread, on XLA:CPU (one stream) and, since grouped requests
  measured slower on an H100, on a GPU too;
* ``grouped`` (for reference): the same server forced to ``mode="grouped"``
  (``--no-grouped`` leaves it out);
* ``jax.jit'`` (the noise floor): the baseline again, as a way of its
  own in every round. Its ratio to ``jax.jit``
  would be 1.00x on a quiet machine; how far it strays says how far any
  ratio of the run can be trusted (``--no-control`` leaves it out).

Method (benchmarks/_common.py): for each thread count, ``--rounds`` rounds;
a round runs each way for ``--seconds``, in alternating order. Reported per
thread count: the median over rounds of serve's throughput over jax.jit's
taken in the same round (the paired ratio, the figure to compare with the
0.95x goal), each way's median throughput, p50 and p99 latency (submit to
result, all rounds pooled), and the load average before and after. Every
batch size of the grouped server is compiled before timing, and the JSON
says how many programs were traced while timing (0 means no compile
stalled a sample). Saves benchmarks/results/serve_<platform>[_quick].json.

  python benchmarks/serve.py [--quick] [--seconds 0.5] [--rounds 10]
      [--groups 4] [--threads 1,4,16,64] [--no-grouped] [--quiet] [--out DIR]

``--quick`` (0.2 s x 4 rounds per point) finishes in about a minute.

On a CPU there are no streams to gain (XLA:CPU has one), so what this shows
there is what the serving path costs over plain threads; on a GPU the
grouped column shows what running requests on separate streams buys (on an
H100 with jax 0.11.2: 0.35x-0.55x of plain threads).
"""

import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxstreams  # noqa: E402
import _common  # noqa: E402

GOAL = 0.95     # serve's throughput over jax.jit's, at every thread count
CONTROL = "jax.jit'"


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


def warm_every_batch_size(server, inputs, groups, seconds=10.0):
  """Runs clients at the grouped server until it has run a batch of every
  size from 1 to ``groups`` (each is its own program), or ``seconds``."""
  deadline = time.monotonic() + seconds
  threads = 4 * groups
  while time.monotonic() < deadline:
    run_clients(server, inputs, threads, 0.3)
    if all(server.stats().batch_sizes.get(k) for k in range(1, groups + 1)):
      return True
  return False


def main():
  parser = _common.parser(__doc__.splitlines()[0],
                          quick="0.2 s x 4 rounds per point")
  parser.add_argument("--seconds", type=float, default=0.5,
                      help="client time per sample")
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--groups", type=int, default=4)
  parser.add_argument("--threads", default="1,4,16,64")
  parser.add_argument("--no-grouped", action="store_true",
                      help="leave out the grouped reference")
  parser.add_argument("--no-control", action="store_true",
                      help="leave out jax.jit', the baseline run again")
  args = parser.parse_args()
  thread_counts = [int(t) for t in args.threads.split(",")]
  if args.quick:
    args.seconds, args.rounds = 0.2, 4

  mlp, features = make_mlp()
  inputs = [jax.random.normal(jax.random.PRNGKey(100 + i), (1, features))
            for i in range(64)]
  jitted = jax.jit(mlp)

  def call_jit(x):
    return jitted(x).block_until_ready()

  server = jaxstreams.serve(mlp, groups=args.groups, queue_size=4096)
  ways = {"jax.jit": call_jit, "serve": server}
  if not args.no_control:
    ways[CONTROL] = call_jit
  grouped = None
  if not args.no_grouped:
    grouped = jaxstreams.serve(mlp, groups=args.groups, queue_size=4096,
                               mode="grouped")
    ways["grouped"] = grouped
  # Same results, and everything compiled before timing: bitwise on XLA:CPU;
  # on a GPU a batch of requests is one wider matmul, tiled differently.
  exact = jax.default_backend() == "cpu"
  for x in inputs[:4]:
    want = np.asarray(jitted(x))
    for name, call in ways.items():
      got = np.asarray(call(x))
      assert (np.array_equal(got, want) if exact else
              np.allclose(got, want, rtol=2e-2, atol=2e-2)), name
  warmed = grouped is None or warm_every_batch_size(grouped, inputs,
                                                    args.groups)
  traced_before = grouped.stats().programs_traced if grouped else 0
  batches_before = dict(grouped.stats().batch_sizes) if grouped else {}

  info = _common.machine()
  print(f"device: {info['device_kind']} ({info['platform']}), jax "
        f"{info['jax']}, {info['cpu_cores']} cores, load {info['load_average_at_start']}; "
        f"MLP 64-256x3-16 at batch 1; serve groups={args.groups}, mode "
        f"{server.mode} ({server.stats().mode_reason}); {args.rounds} rounds "
        f"x {args.seconds} s per way and thread count")
  print(f"{'threads':>7}  {'way':<8} {'req/s':>10} {'p50 us':>9} "
        f"{'p99 us':>9}   paired ratio to jax.jit (throughput)")
  rows = {}
  for threads in thread_counts:
    latencies = {name: [] for name in ways}
    load_before = _common.load()

    def sample(name, call=None):
      def run():
        lat, wall = run_clients(call or ways[name], inputs, threads,
                                args.seconds)
        latencies[name].extend(lat)
        return len(lat) / wall
      return run

    rates = _common.rounds({name: sample(name) for name in ways}, args.rounds)
    row = {"load_average_before": load_before,
           "load_average_after": _common.load()}
    for name in ways:
      lat = np.asarray(latencies[name]) * 1e6
      row[name] = {"throughput_rps_median": float(np.median(rates[name])),
                   "throughput_rps_samples": rates[name],
                   "p50_us": float(np.percentile(lat, 50)),
                   "p99_us": float(np.percentile(lat, 99)),
                   "requests": int(lat.size)}
      if name != "jax.jit":
        row[name]["paired_ratio_to_jit"] = _common.paired(
            rates[name], rates["jax.jit"])
    row["serve_meets_goal"] = row["serve"]["paired_ratio_to_jit"] >= GOAL
    if CONTROL in row:
      # Where the baseline itself strays from 1.00x, so may serve.
      row["noise_floor"] = abs(row[CONTROL]["paired_ratio_to_jit"] - 1.0)
    rows[str(threads)] = row
    for name in ways:
      r = row[name]
      ratio = r.get("paired_ratio_to_jit")
      print(f"{threads:>7}  {name:<8} {r['throughput_rps_median']:>10.0f} "
            f"{r['p50_us']:>9.1f} {r['p99_us']:>9.1f}   "
            + ("" if ratio is None else f"{ratio:.3f}x"), flush=True)

  serve_stats = server.stats()
  server.close()
  result = {
      "benchmark": "serve", "machine": info,
      "load_average_at_end": _common.load(),
      "quiet_machine": args.quiet, "quick": args.quick,
      "model": "MLP 64-256-256-256-16, batch 1, weights closed over",
      "groups": args.groups, "serve_mode": serve_stats.mode,
      "serve_mode_reason": serve_stats.mode_reason,
      "seconds_per_sample": args.seconds, "rounds": args.rounds,
      "goal_serve_over_jit": GOAL, "results_by_threads": rows,
      "control": (None if args.no_control else
                  f"{CONTROL}: the jax.jit baseline run again; its ratio "
                  f"to jax.jit is the run's noise"),
      "note": ("paired_ratio_to_jit: median over rounds of the way's "
               "throughput over jax.jit's in the same round; noisy unless "
               "the machine was quiet (see quiet_machine and the load "
               "averages)"),
  }
  if grouped is not None:
    after = grouped.stats()
    grouped.close()
    result["grouped_every_batch_size_compiled_before"] = warmed
    result["grouped_programs_traced_while_timing"] = (
        after.programs_traced - traced_before)
    result["grouped_batch_sizes"] = {
        k: v - batches_before.get(k, 0) for k, v in after.batch_sizes.items()}
    print(f"grouped: batch sizes while timing (requests per execution: "
          f"executions) {result['grouped_batch_sizes']}; programs traced "
          f"while timing: {result['grouped_programs_traced_while_timing']}")
  name = f"serve_{info['platform']}" + ("_quick" if args.quick else "")
  print(f"saved {_common.save(args.out, name, result)}")


if __name__ == "__main__":
  main()
