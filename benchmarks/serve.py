"""Serving batch-1 requests: jaxstreams.serve against what users run instead.

Three models (benchmarks/serve_models.py: an MLP, a small transformer
encoder, a DLRM-style recommender), each called with batch-1 requests by 1,
4, 16 and 64 client threads. Each client sends one request, waits for its
result and sends the next, for a fixed time. The ways, measured in the same
run:

* ``jax.jit`` (the baseline): every client thread calls ``jax.jit(model)``
  itself and waits for the result;
* ``serve``: ``jaxstreams.serve(model, groups=G)`` in its default
  ``mode="by_platform"`` (direct on XLA:CPU; on a GPU it measures direct
  against grouped at its warm-up and keeps the faster: the JSON records
  which and why);
* ``grouped``: the same server forced to ``mode="grouped"`` (requests that
  arrive together run as one execution, side by side);
* ``vmap batching``: dynamic batching as serving systems do it: a batcher
  thread stacks the queued requests (up to the thread count), runs one
  ``jax.jit(jax.vmap(model))`` padded to a power of two, and hands each
  client its slice;
* ``torch``: the same model and weights in PyTorch, each client thread with
  a CUDA stream of its own (``torch.cuda.stream``) on a GPU, plain threads
  on a CPU; "n/a" where PyTorch is not installed;
* ``jax.jit'`` (the noise floor): the baseline again. Its ratio to
  ``jax.jit`` would be 1.00x on a quiet machine; how far it strays says how
  far any ratio of the run can be trusted (``--no-control`` leaves it out).

Method (benchmarks/_common.py): for each model and thread count,
``--rounds`` rounds; a round runs each way for ``--seconds``, in alternating
order. Reported: the median over rounds of each way's throughput over
jax.jit's in the same round (the paired ratio), each way's median
throughput, p50 and p99 latency (request to result, rounds pooled), and the
load average. Every program is compiled before timing (the servers'
``warmup``, every vmap bucket), and the JSON says how many batch programs
were traced while timing (0: no compile stalled a sample). Results are
checked against ``jax.jit`` before timing (bitwise on XLA:CPU for the
servers). The goals recorded per model: at 16 threads ``serve`` at >= 1.5x
the throughput of ``jax.jit`` with p99 latency <= 1.2x; at 1 thread >= 0.97x.
Saves benchmarks/results/<device>/jax<version>/serve_<platform>[_quick].json and
.txt.

  python benchmarks/serve.py [--quick] [--models mlp,encoder,dlrm]
      [--threads 1,4,16,64] [--seconds 0.3] [--rounds 5] [--groups 4]
      [--no-grouped] [--no-vmap] [--no-torch] [--no-control] [--trace]
      [--quiet] [--out DIR]

``--trace`` profiles threads calling jax.jit and grouped serving at the most
threads (0.2 s each, every model) and records the kernels per GPU stream
and the share of kernel time overlapped: on a GPU it shows whether threads
calling jax.jit run on one compute stream.
"""

from __future__ import annotations

import collections
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
import serve_models  # noqa: E402

CONTROL = "jax.jit'"
GOAL_16_THREADS = 1.5        # serve's throughput over jax.jit's
GOAL_16_THREADS_P99 = 1.2    # serve's p99 latency over jax.jit's, at most
GOAL_1_THREAD = 0.97


def run_clients(call, inputs, threads, seconds):
  """Clients call ``call(*inputs[i])`` in a loop for ``seconds``; returns
  latencies (seconds, all clients pooled) and the wall time."""
  latencies = [[] for _ in range(threads)]
  start_barrier = threading.Barrier(threads + 1)
  stop_at = [0.0]

  def client(t):
    args = inputs[t % len(inputs)]
    mine = latencies[t]
    start_barrier.wait()
    while True:
      t0 = time.perf_counter()
      if t0 >= stop_at[0]:
        return
      call(*args)
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


class VmapBatching:
  """Dynamic batching: clients queue requests; one batcher thread takes what
  is queued (at most ``max_batch``), pads it to a power of two with copies
  of the last request (so every size is one of a few programs) and runs one
  ``jax.jit`` program that stacks the requests, runs ``jax.vmap(fn)`` and
  splits the result, then hands each client its part."""

  def __init__(self, fn, max_batch: int):
    batched = jax.vmap(fn)

    def run(rows):
      stacked = [jnp.stack(column) for column in zip(*rows)]
      out = batched(*stacked)
      return [jax.tree_util.tree_map(lambda o, i=i: o[i], out)
              for i in range(len(rows))]

    self.run = jax.jit(run)
    self.max_batch = max_batch
    self.buckets = [1 << k for k in range(max_batch.bit_length() + 1)
                    if 1 << k < 2 * max_batch]
    self.cond = threading.Condition()
    self.queue: collections.deque = collections.deque()
    self.closed = False
    self.thread = threading.Thread(target=self._loop, daemon=True,
                                   name="benchmark-vmap-batcher")
    self.thread.start()

  def warm(self, args):
    for size in self.buckets:
      jax.block_until_ready(self.run([args] * size))

  def __call__(self, *args):
    slot = [None, threading.Event()]
    with self.cond:
      self.queue.append((args, slot))
      self.cond.notify()
    slot[1].wait()
    if isinstance(slot[0], BaseException):
      raise slot[0]
    return slot[0]

  def _loop(self):
    while True:
      with self.cond:
        while not self.queue and not self.closed:
          self.cond.wait()
        if not self.queue:
          return
        batch = [self.queue.popleft()
                 for _ in range(min(self.max_batch, len(self.queue)))]
      size = next(b for b in self.buckets if b >= len(batch))
      rows = [args for args, _ in batch]
      rows += [rows[-1]] * (size - len(rows))
      try:
        outs = jax.block_until_ready(self.run(rows))
        for out, (_, slot) in zip(outs, batch):
          slot[0] = out
      except Exception as e:  # noqa: BLE001 -- each client gets it
        for _, slot in batch:
          slot[0] = e
      for _, slot in batch:
        slot[1].set()

  def close(self):
    with self.cond:
      self.closed = True
      self.cond.notify()
    self.thread.join()


def torch_way(model, inputs_np):
  """``(call, inputs, device, why_not)``: each client thread runs the model
  in PyTorch on a CUDA stream of its own (on a GPU) and waits for it."""
  try:
    import torch
  except ImportError:
    return None, None, None, "n/a: PyTorch is not installed"
  device = "cuda" if torch.cuda.is_available() else "cpu"
  fn = serve_models.torch_function(model, device)
  inputs = [tuple(torch.as_tensor(a, device=device) for a in args)
            for args in inputs_np]
  local = threading.local()

  def call(*args):
    with torch.inference_mode():
      if device == "cpu":
        return fn(*args)
      stream = getattr(local, "stream", None)
      if stream is None:
        stream = local.stream = torch.cuda.Stream()
      with torch.cuda.stream(stream):
        out = fn(*args)
      stream.synchronize()
      return out

  return call, inputs, device, None


def check(name, got, want, exact):
  for a, b in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    ok = (np.array_equal(a, b) if exact else
          np.allclose(a, b, rtol=2e-2, atol=2e-2))
    assert ok, f"{name}: results differ from jax.jit's"


def bench_model(model, args, info, lines):
  fn = serve_models.jax_function(model)
  inputs_np = [model.inputs(i) for i in range(64)]
  inputs = [tuple(jnp.asarray(a) for a in args_np) for args_np in inputs_np]
  jitted = jax.jit(fn)
  max_threads = max(args.thread_counts)

  def call_jit(*xs):
    return jax.block_until_ready(jitted(*xs))

  ways = {"jax.jit": (call_jit, inputs)}
  servers = {}
  servers["serve"] = jaxstreams.serve(fn, groups=args.groups,
                                      queue_size=4096)
  if not args.no_grouped:
    servers["grouped"] = jaxstreams.serve(fn, groups=args.groups,
                                          queue_size=4096, mode="grouped")
  for name, server in servers.items():
    server.warmup(*inputs[0])        # on a GPU, serve's choice is made here
    ways[name] = (server, inputs)
  batcher = None
  if not args.no_vmap:
    batcher = VmapBatching(fn, max_threads)
    batcher.warm(inputs[0])
    ways["vmap batching"] = (batcher, inputs)
  skipped = {}
  if not args.no_torch:
    call, torch_inputs, device, why_not = torch_way(model, inputs_np)
    if why_not:
      skipped["torch"] = why_not
    else:
      ways[f"torch ({device})"] = (call, torch_inputs)
  if not args.no_control:
    ways[CONTROL] = (call_jit, inputs)

  exact = jax.default_backend() == "cpu"
  for i in range(4):
    want = call_jit(*inputs[i])
    for name, (call, xs) in ways.items():
      got = call(*xs[i])
      if name.startswith("torch"):
        got = jax.tree_util.tree_map(lambda t: t.detach().cpu().numpy(), got)
      check(name, got, want,
            exact and name in ("serve", "grouped", CONTROL))
  traced_before = {n: s.stats().programs_traced for n, s in servers.items()}

  header = (f"{model.name} ({model.description}), batch 1; serve: mode "
            f"{servers['serve'].mode} ({servers['serve'].stats().mode_reason})")
  lines.append(header)
  lines.append(f"{'threads':>7}  {'way':<16} {'req/s':>9} {'p50 us':>9} "
               f"{'p99 us':>9}   paired ratio to jax.jit (throughput)")
  print("\n".join(lines[-2:]), flush=True)
  rows = {}
  for threads in args.thread_counts:
    latencies = {name: [] for name in ways}
    load_before = _common.load()

    def sample(name):
      call, xs = ways[name]

      def run():
        lat, wall = run_clients(call, xs, threads, args.seconds)
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
                   # A short sample under load may complete no request.
                   "p50_us": (float(np.percentile(lat, 50)) if lat.size
                              else float("nan")),
                   "p99_us": (float(np.percentile(lat, 99)) if lat.size
                              else float("nan")),
                   "requests": int(lat.size)}
      if name != "jax.jit":
        row[name]["paired_ratio_to_jit"] = _common.paired(
            rates[name], rates["jax.jit"])
        row[name]["p99_over_jit"] = (row[name]["p99_us"]
                                     / row["jax.jit"]["p99_us"])
    if CONTROL in row:
      row["noise_floor"] = abs(row[CONTROL]["paired_ratio_to_jit"] - 1.0)
    rows[str(threads)] = row
    for name in ways:
      r = row[name]
      ratio = r.get("paired_ratio_to_jit")
      line = (f"{threads:>7}  {name:<16} {r['throughput_rps_median']:>9.0f} "
              f"{r['p50_us']:>9.1f} {r['p99_us']:>9.1f}   "
              + ("" if ratio is None else f"{ratio:.3f}x"))
      lines.append(line)
      print(line, flush=True)

  result = {"model": model.description, "results_by_threads": rows,
            "skipped": skipped, "goals": _goals(rows)}
  if args.trace:
    threads = max(args.thread_counts)
    result["trace"] = {"threads": threads}
    for name in ("jax.jit", "grouped"):
      if name in ways:
        found = traced(*ways[name], threads, 0.2)
        result["trace"][name] = found
        lines.append(f"profiled at {threads} threads, {name}: "
                     + (found.get("error") or
                        f"{found['kernels']} kernels, "
                        f"{found['overlapped_share']:.1%} of kernel time "
                        f"overlapped, kernels per stream "
                        f"{found['kernels_by_stream']}"))
        print(lines[-1], flush=True)
  for name, server in servers.items():
    stats = server.stats()
    server.close()
    result[name] = {
        "mode": stats.mode, "mode_reason": stats.mode_reason,
        "batch_sizes": stats.batch_sizes,
        "programs_traced_while_timing": (stats.programs_traced
                                         - traced_before[name])}
    lines.append(f"{name}: batch sizes {stats.batch_sizes}; batch programs "
                 f"traced while timing: "
                 f"{result[name]['programs_traced_while_timing']}")
    print(lines[-1], flush=True)
  if batcher is not None:
    batcher.close()
  for way, why in skipped.items():
    lines.append(f"{way}: {why}")
    print(lines[-1], flush=True)
  lines.append("")
  return result


def kernels_by_stream(trace: dict) -> dict:
  """From a Chrome/Perfetto trace: how many device kernels ran on each of
  the GPU's streams (the trace's lanes of a GPU process)."""
  gpu_pids = {e["pid"] for e in trace.get("traceEvents", ())
              if e.get("ph") == "M" and e.get("name") == "process_name"
              and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
  counts = collections.Counter(
      f"{e['pid']}/{e.get('tid')}" for e in trace.get("traceEvents", ())
      if e.get("ph") == "X" and e.get("pid") in gpu_pids)
  return dict(counts)


def traced(call, inputs, threads: int, seconds: float) -> dict:
  """Clients run under jax.profiler: the share of kernel time during which
  two or more kernels ran at once, and the kernels per stream. Threads
  calling jax.jit should show one stream (JAX's GPU clients launch every
  execution on one compute stream); grouped serving, several."""
  import glob
  import gzip
  import json
  import tempfile
  from gpu_levers import kernel_overlap
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      run_clients(call, inputs, threads, seconds)
    found = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"),
                      recursive=True)
    if not found:
      return {"error": "no perfetto trace written"}
    with gzip.open(found[0], "rt") as f:
      trace = json.load(f)
  return {**kernel_overlap(trace),
          "kernels_by_stream": kernels_by_stream(trace)}


def _goals(rows):
  """Whether serve met the goals, where the thread counts were run."""
  goals = {}
  if "16" in rows:
    serve = rows["16"]["serve"]
    goals["serve_16_threads_throughput"] = serve["paired_ratio_to_jit"]
    goals["serve_16_threads_p99_over_jit"] = serve["p99_over_jit"]
    goals["met_at_16_threads"] = (
        serve["paired_ratio_to_jit"] >= GOAL_16_THREADS
        and serve["p99_over_jit"] <= GOAL_16_THREADS_P99)
  if "1" in rows:
    goals["serve_1_thread_throughput"] = (
        rows["1"]["serve"]["paired_ratio_to_jit"])
    goals["met_at_1_thread"] = (goals["serve_1_thread_throughput"]
                                >= GOAL_1_THREAD)
  return goals


def main():
  parser = _common.parser(__doc__.splitlines()[0],
                          quick="the MLP only, 0.1 s x 2 rounds, 1 and 16 "
                                "threads")
  parser.add_argument("--models", default="mlp,encoder,dlrm")
  parser.add_argument("--threads", default="1,4,16,64")
  parser.add_argument("--seconds", type=float, default=0.3,
                      help="client time per sample")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--groups", type=int, default=4)
  parser.add_argument("--no-grouped", action="store_true",
                      help="leave out serve forced to mode='grouped'")
  parser.add_argument("--no-vmap", action="store_true",
                      help="leave out vmap batching")
  parser.add_argument("--no-torch", action="store_true",
                      help="leave out PyTorch")
  parser.add_argument("--no-control", action="store_true",
                      help="leave out jax.jit', the baseline run again")
  parser.add_argument("--trace", action="store_true",
                      help="profile jax.jit and grouped at the most threads: "
                      "kernel overlap and kernels per GPU stream")
  args = parser.parse_args()
  if args.quick:
    args.models, args.threads, args.seconds, args.rounds = "mlp", "1,16", 0.1, 2
  args.thread_counts = [int(t) for t in args.threads.split(",")]
  names = args.models.split(",")
  unknown = sorted(set(names) - set(serve_models.MODELS))
  if unknown:
    parser.error(f"unknown models {unknown}; known: "
                 f"{sorted(serve_models.MODELS)}")

  info = _common.machine()
  lines = [f"device: {info['device_kind']} ({info['platform']}), jax "
           f"{info['jax']}, {info['cpu_cores']} cores, load "
           f"{info['load_average_at_start']}; groups={args.groups}; "
           f"{args.rounds} rounds x {args.seconds} s per way, model and "
           "thread count", ""]
  print(lines[0], flush=True)
  models = {name: bench_model(serve_models.MODELS[name](), args, info, lines)
            for name in names}
  result = {
      "benchmark": "serve", "machine": info,
      "load_average_at_end": _common.load(),
      "quiet_machine": args.quiet, "quick": args.quick, "groups": args.groups,
      "seconds_per_sample": args.seconds, "rounds": args.rounds,
      "goals": {"serve_over_jit_at_16_threads": GOAL_16_THREADS,
                "p99_over_jit_at_16_threads_at_most": GOAL_16_THREADS_P99,
                "serve_over_jit_at_1_thread": GOAL_1_THREAD},
      "models": models,
      "control": (None if args.no_control else
                  f"{CONTROL}: the jax.jit baseline run again; its ratio "
                  f"to jax.jit is the run's noise"),
      "note": ("paired_ratio_to_jit: median over rounds of the way's "
               "throughput over jax.jit's in the same round; noisy unless "
               "the machine was quiet (see quiet_machine and the load "
               "averages)"),
  }
  name = f"serve_{info['platform']}" + ("_quick" if args.quick else "")
  print("saved "
        f"{_common.save(args.out, name, result, text=chr(10).join(lines))}")


if __name__ == "__main__":
  main()
