"""What jaxstreams.jit costs over jax.jit: per call, and at the first call.

Per call: both wrappers dispatch a compiled executable of a tiny function;
what is measured is the Python and dispatch cost around it. Batches of
calls (each ends with block_until_ready on the last result), alternating the
wrappers batch by batch; the median time per call and its ratio to jax.jit.

First call (``jaxstreams.choose.choice``): trace, plan and compile, against
``jax.jit``'s first call of the same function, for the demo's two-tower
training step and a transformer training step (12 layers of width 1024,
sequence 512, batch 8, vocabulary 32000; each layer's attention on stream 1
and its MLP on stream 2, as in parallel-block transformers), and the same
transformer with no stream blocks (a plan on one stream). Paired rounds in
alternating order, each sample a fresh function after ``jax.clear_caches()``;
the on-disk cache of decisions is off. Reported per model: both first calls
and their paired ratio, the compiles made beside jaxstreams' first call
(each way's seconds, and when the last was done) and, on a GPU, the calls
and seconds until the function chose its way, and the way.

* Without a GPU the programs are compiled for an H100 (``gpu_target``; the
  CUDA plugin at jaxlib's version, ``JAX_PLATFORMS=cpu``): XLA:GPU's whole
  compile runs on this machine's CPUs. jaxstreams' first call is its own
  code path up to the program it runs: ``settle`` (plan, lowering, the disk
  cache, the compiles started beside it), then that program traced, lowered
  and compiled as a call would; ``jax.jit``'s is ``trace().lower().
  compile()``. Nothing runs, so nothing is timed and nothing decided (and
  nothing estimated: ``jaxstreams_estimate_target`` is ``none``, as a
  GPU's first calls do not estimate).
* On a GPU the first calls are calls, and the models of ``gpu_levers.py``
  (the suite's) are measured too; the function is then called until its way
  is chosen.

  python benchmarks/jit_overhead.py [--calls 2000] [--batches 31]
      [--rounds 3] [--part all|per_call|first_call] [--models a,b]
      [--quick] [--out DIR]

Results: ``jit_overhead_<platform>_jax<version>[_<part>][_quick].{json,txt}``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import _common  # noqa: E402
import jaxstreams  # noqa: E402

STREAMS = 3
TRANSFORMER = dict(layers=12, width=1024, heads=16, seq=512, batch=8,
                   vocab=32000)
QUICK_TRANSFORMER = dict(layers=2, width=64, heads=4, seq=32, batch=2,
                         vocab=256)
DEMO = dict(towers=2, width=512, depth=4, batch=8)      # streams_demo's
QUICK_DEMO = dict(towers=2, width=32, depth=1, batch=4)


# ---------------------------------------------------------------------------
# Per call.

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


def per_call(calls: int, batches: int) -> tuple[dict, list[str]]:
  x = jnp.float32(1.0)
  candidates = {
      "jax.jit": jax.jit(tiny),
      "jaxstreams.jit(streams=1)": jaxstreams.jit(tiny, streams=1),
      "jaxstreams.jit(streams from option)": jaxstreams.jit(tiny),
      "jax.jit, two-part function": jax.jit(tiny_with_region),
      "jaxstreams.jit(streams=2), region": jaxstreams.jit(tiny_with_region,
                                                         streams=2),
  }
  baselines = {"jaxstreams.jit(streams=1)": "jax.jit",
               "jaxstreams.jit(streams from option)": "jax.jit",
               "jaxstreams.jit(streams=2), region":
                   "jax.jit, two-part function"}
  for fn in candidates.values():
    for _ in range(200):
      fn(x).block_until_ready()
  samples = {name: [] for name in candidates}
  for _ in range(batches):
    for name, fn in candidates.items():
      samples[name].append(time_batch(fn, x, calls))
  medians = {name: statistics.median(s) for name, s in samples.items()}
  lines = []
  for name, seconds in medians.items():
    line = f"  {name:40s} {seconds * 1e6:8.2f} us/call"
    if name in baselines:
      line += (f"   x{medians[name] / medians[baselines[name]]:.3f} vs "
               f"{baselines[name]}")
    lines.append(line)
  return {"calls_per_batch": calls, "batches": batches,
          "median_us_per_call": {k: v * 1e6 for k, v in medians.items()},
          "ratio_to_baseline": {k: medians[k] / medians[b]
                                for k, b in baselines.items()}}, lines


# ---------------------------------------------------------------------------
# Models for the first call.

def transformer(size, streams: bool):
  """(make_fn, args): a fresh training step per call of make_fn, and its
  parameters and tokens. Each layer's attention and MLP read the same
  normalized input (a parallel block); with ``streams`` they are on streams
  1 and 2."""
  layers, d, heads, s, b, v = (size[k] for k in ("layers", "width", "heads",
                                                  "seq", "batch", "vocab"))

  def dense(key, shape):
    return jax.random.normal(key, shape, jnp.float32) * shape[0] ** -0.5

  def init(key):
    ks = jax.random.split(key, 4 * layers + 2)
    return {"embed": dense(ks[-2], (v, d)), "out": dense(ks[-1], (d, v)),
            "layers": [{"qkv": dense(ks[4 * i], (d, 3 * d)),
                        "proj": dense(ks[4 * i + 1], (d, d)),
                        "up": dense(ks[4 * i + 2], (d, 4 * d)),
                        "down": dense(ks[4 * i + 3], (4 * d, d)),
                        "scale": jnp.ones((d,))} for i in range(layers)]}

  def attention(p, h):
    q, k, val = (t.reshape(b, s, heads, d // heads)
                 for t in jnp.split(h @ p["qkv"], 3, axis=-1))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // heads) ** -0.5
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e9)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), val)
    return mixed.reshape(b, s, d) @ p["proj"]

  def mlp(p, h):
    return jax.nn.gelu(h @ p["up"]) @ p["down"]

  def make_fn():
    def block(p, x):
      h = (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
           * p["scale"])
      if not streams:
        return x + attention(p, h) + mlp(p, h)
      with jaxstreams.stream(1):
        a = attention(p, h)
      with jaxstreams.stream(2):
        m = mlp(p, h)
      return x + a + m

    def loss(params, tokens):
      x = params["embed"][tokens]
      for p in params["layers"]:
        x = block(p, x)
      logits = jax.nn.log_softmax(x[:, :-1] @ params["out"])
      return -jnp.mean(jnp.take_along_axis(logits, tokens[:, 1:, None], -1))

    def train_step(params, tokens):
      value, grads = jax.value_and_grad(loss)(params, tokens)
      return value, jax.tree_util.tree_map(lambda w, g: w - 1e-3 * g,
                                           params, grads)
    return train_step

  key = jax.random.PRNGKey(0)
  if jax.default_backend() == "gpu":
    params = init(key)
    tokens = jax.random.randint(key, (b, s), 0, v)
  else:   # shapes only: compiled for a GPU this machine does not have
    params = jax.eval_shape(init, key)
    tokens = jax.ShapeDtypeStruct((b, s), jnp.int32)
  return make_fn, (params, tokens)


def demo(size):
  import streams_demo
  key = jax.random.PRNGKey(0)
  params = streams_demo.init(size["towers"], size["width"], size["depth"], key)
  x = jnp.ones((size["batch"], size["width"]))
  y = jnp.ones((size["batch"], 1))
  return (lambda: streams_demo.make_step(size["towers"])), (params, x, y)


MODEL_SETS = ("demo", "transformer", "transformer_one_stream", "suite")


def models(quick: bool, wanted: set[str]) -> list[tuple[str, object, tuple]]:
  """(name, make_fn, args) of each model asked for; ``suite`` (the models of
  gpu_levers.py) on a GPU only."""
  tf = QUICK_TRANSFORMER if quick else TRANSFORMER
  tf_name = f"transformer training step, {tf['layers']} layers"
  found = []
  if "demo" in wanted:
    found.append(("demo training step", *demo(QUICK_DEMO if quick else DEMO)))
  if "transformer" in wanted:
    found.append((tf_name + ", attention and MLP on streams 1 and 2",
                  *transformer(tf, streams=True)))
  if "transformer_one_stream" in wanted:
    found.append((tf_name + ", one stream", *transformer(tf, streams=False)))
  if "suite" in wanted and jax.default_backend() == "gpu":
    import gpu_levers
    from workloads import common
    for name, model, size in gpu_levers.MODELS:
      if quick and name not in gpu_levers.QUICK_SIZES:
        continue
      size = gpu_levers.QUICK_SIZES[name] if quick else size
      make_fn, args = model(size, gpu_levers.STREAMS, jax.random.PRNGKey(0))
      found.append((name, lambda make_fn=make_fn: _placed(make_fn, common),
                    args))
  return found


def _placed(make_fn, common):
  """The suite's model with jaxstreams' placement (streams blocks)."""
  return make_fn(common.place_jaxstreams)


# ---------------------------------------------------------------------------
# First calls.

def _two_regions(x):
  with jaxstreams.stream(1):
    a = jnp.tanh(x @ x)
  with jaxstreams.stream(2):
    b = jnp.sin(x @ x.T)
  return (a * b).sum()


def first_call_jax(make_fn, args) -> float:
  jax.clear_caches()
  fn = jax.jit(make_fn())
  start = time.perf_counter()
  if jax.default_backend() == "gpu":
    jax.block_until_ready(fn(*args))
  else:
    fn.trace(*args).lower().compile()
  return time.perf_counter() - start


def first_call_ours(make_fn, args, record: list) -> float:
  """jaxstreams' first call; appends what happened after it to ``record``."""
  jax.clear_caches()
  f = jaxstreams.jit(make_fn(), streams=STREAMS)
  start = time.perf_counter()
  if jax.default_backend() == "gpu":
    jax.block_until_ready(f(*args))
  else:
    target = f._chooser.settle(args, {})
    target.trace(*args).lower().compile()
  seconds = time.perf_counter() - start
  compiles = f._chooser.wait_compiled(args, {})
  entry = {"compiled_beside_s": compiles,
           "all_compiled_after_s": time.perf_counter() - start}
  if jax.default_backend() == "gpu":
    calls = 1
    while f._chooser.deciding(args, {}) and calls < 5000:
      jax.block_until_ready(f(*args))
      calls += 1
    entry.update(calls_to_decide=calls,
                 decided_after_s=time.perf_counter() - start)
  plan = f.plan(*args)
  entry.update(way=plan.gpu_lowering, reason=plan.gpu_reason)
  record.append(entry)
  return seconds


def first_calls(rounds: int, quick: bool, wanted: set[str]
                ) -> tuple[list, list[str]]:
  if jax.default_backend() != "gpu":
    try:
      target = jaxstreams.gpu_target("h100")
    except jaxstreams.GpuTargetError as error:
      return [], [f"  first calls: not measured: {error}"]
    # A GPU's first call times the ways; without one, lowering for the
    # target would choose by the estimate instead (compiling every way).
    # What is measured is the GPU's path.
    jaxstreams.config.update("jaxstreams_estimate_target", "none")
  if not quick:
    # What a process pays once (loading XLA:GPU's compiler, jaxstreams'
    # modules) goes to neither side: a tiny first call of each, unrecorded.
    tiny_args = (jnp.ones((8, 8)),)
    if jax.default_backend() != "gpu":
      tiny_args = target.abstract(*tiny_args)
    first_call_jax(lambda: _two_regions, tiny_args)
    first_call_ours(lambda: _two_regions, tiny_args, [])
  cases, lines = [], []
  for name, make_fn, args in models(quick, wanted):
    if jax.default_backend() != "gpu":
      args = target.abstract(*args)
    record: list = []
    samples = _common.rounds({
        "jax.jit": lambda: first_call_jax(make_fn, args),
        "jaxstreams.jit": lambda: first_call_ours(make_fn, args, record)},
        rounds)
    ratio = _common.paired(samples["jaxstreams.jit"], samples["jax.jit"])
    beside = [sum(r["compiled_beside_s"].values()) for r in record]
    case = {"model": name, "samples_s": samples, "paired_ratio": ratio,
            "median_s": {k: statistics.median(v) for k, v in samples.items()},
            "after_first_call": record, "load_average": _common.load()}
    cases.append(case)
    last = record[-1]
    line = (f"  {name}: jax.jit {case['median_s']['jax.jit']:.2f} s, "
            f"jaxstreams.jit {case['median_s']['jaxstreams.jit']:.2f} s "
            f"(paired x{ratio:.2f}); compiled beside it: "
            f"{', '.join(sorted(last['compiled_beside_s'])) or 'nothing'}")
    if last["compiled_beside_s"]:
      line += (
          f" ({statistics.median(beside):.2f} s of compiles, the last done "
          f"{statistics.median(r['all_compiled_after_s'] for r in record):.2f}"
          " s after the first call began)")
    if "calls_to_decide" in last:
      line += (f"; chose {last['way']!r} after {last['calls_to_decide']} "
               f"calls, {last['decided_after_s']:.2f} s")
    else:
      line += f"; way {last['way']!r} (nothing runs here: nothing is timed)"
    lines.append(line)
  return cases, lines


def main():
  p = _common.parser(__doc__.splitlines()[0],
                     "tiny models, one round of first calls")
  p.add_argument("--calls", type=int, default=2000)
  p.add_argument("--batches", type=int, default=31)
  p.add_argument("--rounds", type=int, default=3,
                 help="paired rounds of first calls per model")
  p.add_argument("--part", choices=("all", "per_call", "first_call"),
                 default="all", help="measure one part only")
  p.add_argument("--models", default=",".join(MODEL_SETS),
                 help="first calls of which models, of "
                      f"{', '.join(MODEL_SETS)} (suite: on a GPU only)")
  args = p.parse_args()
  jaxstreams.config.update("jaxstreams_autotune", True)   # what is measured
  jaxstreams.config.update("jaxstreams_autotune_cache", "none")
  device = jax.devices()[0]
  result = {"benchmark": "jit_overhead", "machine": _common.machine(),
            "quiet": args.quiet}
  lines = []
  if args.part in ("all", "per_call"):
    result["per_call"], more = per_call(args.calls, args.batches)
    lines += ["per call:"] + more
  if args.part in ("all", "first_call"):
    where = ("on this GPU" if device.platform == "gpu" else
             "compiled for an H100 on this machine's CPUs (no GPU)")
    lines.append(f"first calls, {where}, {STREAMS} streams:")
    wanted = set(args.models.split(","))
    unknown = wanted - set(MODEL_SETS)
    if unknown:
      p.error(f"unknown --models {sorted(unknown)}; choose from {MODEL_SETS}")
    result["first_calls"], more = first_calls(1 if args.quick else args.rounds,
                                              args.quick, wanted)
    lines += more
  m = result["machine"]
  text = "\n".join(
      [f"device: {device.device_kind} ({device.platform}), jax "
       f"{jax.__version__}; {m['cpu_cores_usable']} cores, load average "
       f"{m['load_average_at_start']} at start, {_common.load()} at end"]
      + lines) + "\n"
  print(text, end="")
  suffix = ("" if args.part == "all" else f"_{args.part}") + (
      "_quick" if args.quick else "")
  path = _common.save(args.out, f"jit_overhead_{device.platform}_jax"
                      f"{jax.__version__}{suffix}", result, text)
  print("saved", path)


if __name__ == "__main__":
  main()
