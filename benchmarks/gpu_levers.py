"""Every GPU way of running the suite's programs, timed in one run on a GPU.

What decides jaxstreams' default GPU lowering (``jaxstreams.lower.gpu``):
each model's program compiled every way, timed in interleaved rounds:

* ``jax.jit`` with XLA's defaults (the reference), with XLA's CONCURRENT
  command-buffer scheduling, and with command buffers off (no CUDA graphs);
* ``jaxstreams.jit`` forced to each way (``gpu_lowering=``: ``inline``,
  ``concurrent``, ``loops``, ``loops_concurrent``, ``streams``,
  ``streams_concurrent``);
* ``jaxstreams.jit`` as it runs by default: its first calls on a GPU time
  the candidates and keep the fastest (the decision, the first call's time
  and the calls it took are recorded; the autotune cache is off for the
  run, so it really times).

Models (``--models suite``, the default): K independent chains of small
matmuls (the case streams exist for), the suite's Inception-style,
DLRM-style (training) and MLP-bank models at one size each, the demo's
two-tower training step, and a negative control (one chain, nothing to
overlap). ``--models loops``: towers of loops, which XLA runs outside its
CUDA graphs (a CLIP-style dual encoder of two 12-layer scanned transformer
towers, forward and training step; a bank of GRUs in ``lax.scan``; an
ensemble of RK4 solves in ``fori_loop``) and the Inception-style model
(convolutions); each tower workload also as PyTorch on the same weights,
on one stream and with a ``torch.cuda.Stream`` per tower
(``workloads/torch_towers.py``; where PyTorch sees a GPU). ``--models
models``: models as users write them (``flax.linen``, ``flax.nnx`` and
equinox dual encoders with scanned towers of 12 and 12 or 24 and 12 layers,
a checkpointed tower, a multi-task model with scanned heads; forward pass
and optax training step), the linen dual encoder against PyTorch on its
weights. Method: every program compiled ahead of time; a
sample is ``calls`` calls each ended by ``block_until_ready``; ``--rounds``
rounds in alternating order; reported: each program's median ms and the
paired ratio jax.jit (defaults) / program (above 1: faster).

Memory beside each timing: XLA's memory analysis of each compiled program
(its temporary buffers, and arguments + outputs + temporaries less what is
aliased: what the program holds while it runs), and for PyTorch the peak
that ``torch.cuda.max_memory_allocated`` measured over its timed calls.

Overlap evidence (``--trace``): each program run under ``jax.profiler``; from
the trace, the share of GPU kernel time during which another kernel ran too
(0 where everything ran in sequence).

  python benchmarks/gpu_levers.py [--models suite|loops|models|NAMES]
                                 [--rounds 15] [--ways NAMES] [--trace]
                                 [--quick] [--out DIR]
"""

from __future__ import annotations

import functools
import glob
import gzip
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "examples"))
import _common  # noqa: E402
from workloads import (common, control, dlrm, dual_encoder, gru_bank,  # noqa: E402
                       inception, mlp_bank, ode_ensemble, torch_towers)
from workloads import (equinox_dual_encoder, linen_dual_encoder,  # noqa: E402
                       linen_multitask, nnx_dual_encoder)

import jaxstreams  # noqa: E402
from jaxstreams.lower import gpu  # noqa: E402

NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
STREAMS = 4


def chains_model(size, streams, key):
  """K independent chains of ``depth`` small matmuls; chain k on stream k+1."""
  k, depth, n, batch = size["chains"], size["depth"], size["n"], size["batch"]
  keys = jax.random.split(key, k + 1)
  ws = [jax.random.normal(keys[i], (depth, n, n), jnp.bfloat16) * n ** -0.5
        for i in range(k)]
  x = jax.random.normal(keys[-1], (batch, n), jnp.bfloat16)

  def chain(h, w):
    for d in range(depth):
      h = jnp.tanh(h @ w[d])
    return h

  def make_fn(place):
    def f(ws, x):
      outs = [place(1 + i % (streams - 1), chain, x, w)
              for i, w in enumerate(ws)]
      return sum(o.astype(jnp.float32).sum() for o in outs)
    return f
  return make_fn, (ws, x)


def demo_model(size, streams, key):
  """The demo's two-tower training step (its stream blocks are its own)."""
  import streams_demo
  params = streams_demo.init(size["towers"], size["width"], size["depth"], key)
  x = jnp.ones((size["batch"], size["width"]))
  y = jnp.ones((size["batch"], 1))
  step = streams_demo.make_step(size["towers"])
  return (lambda place: step), (params, x, y)


def control_model(size, streams, key):
  n = size["n"]
  ks = jax.random.split(key, size["depth"] + 1)
  ws = [common.normal(k, (n, n), n ** -0.5) for k in ks[1:]]
  x = common.normal(ks[0], (size["batch"], n))
  return control.make_fn(size), (ws, x)


MODELS = [
    ("chains", chains_model, dict(chains=4, depth=40, n=256, batch=8)),
    ("inception", inception.model, dict(batch=8, hw=17, channels=64, blocks=4)),
    ("dlrm", dlrm.model, dict(mode="train", towers=8, batch=256, vocab=4096,
                              dim=32, hot=4, hidden=128)),
    ("mlp_bank", mlp_bank.model, dict(models=8, batch=32, width=128, depth=3,
                                      d_in=64, d_out=8)),
    ("demo", demo_model, dict(towers=2, width=256, depth=2, batch=64)),
    ("control", control_model, dict(placement="one stream", n=512, batch=512,
                                    depth=8)),
]
# Towers of loops (XLA runs a loop outside its CUDA graphs) and the
# Inception-style model (convolutions, outside its graphs by default), each
# against PyTorch with a CUDA stream per tower where it is installed:
# --models loops.
LOOP_MODELS = [
    ("dual_encoder", dual_encoder.model, dict(
        batch=32, width=512, heads=8, layers=12, patches=50, tokens=32,
        mode="forward")),
    ("dual_encoder_train", dual_encoder.model, dict(
        batch=32, width=512, heads=8, layers=12, patches=50, tokens=32,
        mode="train")),
    ("gru_bank", gru_bank.model, dict(models=4, batch=16, inputs=64,
                                      hidden=256, steps=64, mode="forward")),
    ("ode_ensemble", ode_ensemble.model, dict(members=4, batch=64, dim=32,
                                              width=256, steps=50)),
    ("inception", inception.model, dict(batch=8, hw=17, channels=64, blocks=4)),
]
# Models as users write them (flax.linen, flax.nnx, equinox): --models models.
_CLIP = linen_dual_encoder.CLIP_SHAPES
MODEL_MODELS = [
    ("linen_12_12", linen_dual_encoder.model,
     dict(_CLIP, depths=(12, 12), mode="forward", wrap="plain")),
    ("linen_12_12_train", linen_dual_encoder.model,
     dict(_CLIP, depths=(12, 12), mode="train", wrap="plain")),
    ("linen_24_12_train", linen_dual_encoder.model,
     dict(_CLIP, depths=(24, 12), mode="train", wrap="plain")),
    ("linen_remat_12_12_train", linen_dual_encoder.model,
     dict(_CLIP, depths=(12, 12), mode="train", wrap="remat")),
    ("nnx_12_12_train", nnx_dual_encoder.model,
     dict(_CLIP, depths=(12, 12), mode="train")),
    ("equinox_12_12_train", equinox_dual_encoder.model,
     dict(_CLIP, depths=(12, 12), mode="train")),
    ("linen_multitask_train", linen_multitask.model,
     linen_multitask.sizes(quick=False)[1]),
]
_QUICK_CLIP = linen_dual_encoder.sizes(quick=True)[0]
QUICK_SIZES = {"chains": dict(chains=2, depth=2, n=16, batch=4),
               "demo": dict(towers=2, width=16, depth=1, batch=4),
               "dual_encoder": dual_encoder.sizes(quick=True)[0],
               "gru_bank": dict(gru_bank.sizes(quick=True)[0], mode="forward"),
               "ode_ensemble": ode_ensemble.sizes(quick=True)[0]}


def _quick_model_size(model, size):
  """A model's quick size, with the mode, wrap and unequal depths of
  ``size`` (depths scaled down)."""
  quick = dict(sys.modules[model.__module__].sizes(quick=True)[0])
  quick.update({k: size[k] for k in ("mode", "wrap") if k in size})
  if "depths" in size and size["depths"][0] != size["depths"][1]:
    quick["depths"] = (4, 2)
  return quick


QUICK_SIZES.update({name: _quick_model_size(model, size)
                    for name, model, size in MODEL_MODELS})
# The PyTorch model of each tower workload (torch_towers.NAMES).
_TORCH = {"dual_encoder": "dual_encoder", "dual_encoder_train": "dual_encoder",
          "gru_bank": "gru_bank", "ode_ensemble": "ode_ensemble",
          **{name: "linen_dual_encoder" for name, _, _ in MODEL_MODELS
             if name.startswith("linen_") and "multitask" not in name}}


def compile_ways(make_fn, args, only=None):
  """name -> compiled program, and what the default chose, for every way
  (``jax.jit``, the default and the ways named in ``only`` where given)."""
  plain = jax.jit(make_fn(common.place_none))
  wanted = lambda name: only is None or name in only
  ways = {"jax.jit": plain.lower(*args).compile()}
  for name, options in (("jax.jit, CONCURRENT", common.CONCURRENT_OPTIONS),
                        ("jax.jit, no command buffers", NO_COMMAND_BUFFERS)):
    if wanted(name):
      ways[name] = plain.lower(*args).compile(compiler_options=options)
  for way in gpu.WAYS:
    if not wanted(f"jaxstreams {way}"):
      continue
    forced = jaxstreams.jit(make_fn(common.place_jaxstreams), streams=STREAMS,
                            gpu_lowering=way)
    ways[f"jaxstreams {way}"] = forced.lower(*args).compile()
  default = jaxstreams.jit(make_fn(common.place_jaxstreams), streams=STREAMS)
  start = time.perf_counter()
  jax.block_until_ready(default(*args))   # on a GPU: compiles the candidates
  first_call_s = time.perf_counter() - start
  calls = 1
  while default._chooser.deciding(args, {}) and calls < 5000:
    # on a GPU: these calls time them
    jax.block_until_ready(default(*args))
    calls += 1
  plan = default.plan(*args)
  ways["jaxstreams default"] = default.lower(*args).compile()
  chosen = {"way": plan.gpu_lowering, "reason": plan.gpu_reason,
            "first_call_s": first_call_s, "calls_to_decide": calls,
            "decided_s": time.perf_counter() - start}
  return ways, chosen


def sampler(run, calls, wait=jax.block_until_ready):
  """A sample: ``calls`` calls of ``run`` (no arguments), each waited for
  with ``wait``; milliseconds per call."""
  def sample():
    start = time.perf_counter()
    for _ in range(calls):
      wait(run())
    return (time.perf_counter() - start) / calls * 1e3
  return sample


def torch_ways(name: str, size: dict, args) -> dict:
  """The PyTorch anchors of a tower workload on the GPU (one stream, a
  stream per tower): name -> a step of no arguments; none where PyTorch or
  its CUDA is missing (and why, in the second result)."""
  if name not in _TORCH:
    return {}, None
  problem = torch_towers.problem("cuda")
  if problem is not None:
    return {}, problem
  return {f"pytorch, {label}": torch_towers.build(
      _TORCH[name], size, args, device="cuda", streams=streams)
      for label, streams in (("one stream", False),
                             ("a stream per tower", True))}, None


def memory(compiled) -> dict:
  """XLA's memory analysis of a compiled program, in MB: its temporary
  buffers, and what it holds while it runs (arguments, outputs and
  temporaries, less the outputs that alias arguments)."""
  try:
    m = compiled.memory_analysis()
  except Exception as e:  # noqa: BLE001 - reported in the results
    return {"error": str(e)[:200]}
  if m is None:
    return {"error": "no memory analysis on this backend"}
  mb = 1 / 2 ** 20
  held = (m.argument_size_in_bytes + m.output_size_in_bytes
          + m.temp_size_in_bytes - m.alias_size_in_bytes)
  return {"temp_mb": m.temp_size_in_bytes * mb, "held_mb": held * mb}


def torch_peak(step, calls: int) -> dict:
  """The peak device memory PyTorch allocated over ``calls`` calls of a
  step, in MB (None off a GPU)."""
  import torch
  if not torch.cuda.is_available():
    return {"peak_mb": None}
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  for _ in range(calls):
    step()
  torch.cuda.synchronize()
  return {"peak_mb": torch.cuda.max_memory_allocated() / 2 ** 20}


def anchor_check(reference_out, anchors: dict) -> dict:
  """What PyTorch's first step returned against ``jax.jit``'s result on the
  same weights and inputs: the largest difference of the loss (a training
  step) or of the embeddings (a forward pass). Both on the GPU's default
  matmul precision, so not bitwise; large differences mean the anchor
  computes something else."""
  import numpy as np
  out = {}
  for way, step in anchors.items():
    got = step().detach().cpu().numpy()
    if isinstance(reference_out, tuple) and len(reference_out) == 2:
      # embeddings
      want = np.concatenate([np.asarray(x) for x in reference_out])
    else:
      # the loss
      want = np.asarray(jax.tree_util.tree_leaves(reference_out)[0])
    out[way] = float(np.max(np.abs(got - want)))
  return out


def _torch_wait(out):
  import torch
  del out
  torch.cuda.synchronize()


def torch_overlap(step, calls: int) -> dict:
  """Kernel overlap of a PyTorch step from torch.profiler's trace."""
  import torch
  with tempfile.TemporaryDirectory() as folder:
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
      for _ in range(calls):
        step()
      torch.cuda.synchronize()
    path = os.path.join(folder, "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
      trace = json.load(f)
  for event in trace.get("traceEvents", ()):   # kernels into one "GPU" pid
    if event.get("cat") == "kernel":
      event["pid"] = "gpu"
  trace["traceEvents"].append({"ph": "M", "name": "process_name", "pid": "gpu",
                               "args": {"name": "gpu"}})
  return kernel_overlap(trace)


def kernel_overlap(trace: dict) -> dict:
  """From a Chrome/Perfetto trace: the device's kernel spans (events of the
  processes named like a GPU), their busy time, and the share of it during
  which two or more ran at once."""
  gpu_pids = {e["pid"] for e in trace.get("traceEvents", ())
              if e.get("ph") == "M" and e.get("name") == "process_name"
              and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
  spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
                 for e in trace.get("traceEvents", ())
                 if e.get("ph") == "X" and e.get("pid") in gpu_pids
                 and float(e.get("dur", 0)) > 0)
  edges = sorted([(s, 1) for s, _ in spans] + [(t, -1) for _, t in spans])
  busy = overlapped = 0.0
  active, last = 0, None
  for t, delta in edges:
    if last is not None and active:
      busy += t - last
      if active > 1:
        overlapped += t - last
    active += delta
    last = t
  return {"kernels": len(spans), "busy_us": busy,
          "overlapped_share": overlapped / busy if busy else 0.0}


def traced_overlap(compiled, args, calls: int) -> dict:
  """Run ``calls`` calls under jax.profiler and read the overlap back."""
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      for _ in range(calls):
        jax.block_until_ready(compiled(*args))
    found = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"),
                      recursive=True)
    if not found:
      return {"error": "no perfetto trace written"}
    with gzip.open(found[0], "rt") as f:
      return kernel_overlap(json.load(f))


def main():
  p = _common.parser(__doc__.splitlines()[0],
                     "3 rounds, the two smallest models at tiny sizes")
  p.add_argument("--rounds", type=int, default=15)
  p.add_argument("--target-ms", type=float, default=20.0)
  p.add_argument("--ways", default=None,
                 help="only these ways besides jax.jit and the default, "
                 "names as printed, joined by commas (default: every way)")
  p.add_argument("--trace", action="store_true",
                 help="profile each program and report kernel overlap")
  p.add_argument("--models", default="suite",
                 help="'suite' (the six models), 'loops' (towers of loops and "
                 "the Inception-style model, with PyTorch anchors), 'models' "
                 "(flax.linen, flax.nnx and equinox models), or names joined "
                 "by commas")
  args_ = p.parse_args()
  if jax.default_backend() != "gpu" and not args_.quick:
    raise SystemExit("gpu_levers.py measures XLA:GPU options: it needs a GPU "
                     "(--quick runs it anywhere, to check that it works)")
  # Time the candidates at every default function's first call.
  jaxstreams.config.update("jaxstreams_autotune_cache", "none")
  every = {n: (n, m, size) for n, m, size in MODELS + LOOP_MODELS
           + MODEL_MODELS}
  groups = {"suite": MODELS, "loops": LOOP_MODELS, "models": MODEL_MODELS}
  chosen_names = ([n for n, _, _ in groups[args_.models]]
                  if args_.models in groups else args_.models.split(","))
  unknown = [n for n in chosen_names if n not in every]
  if unknown:
    raise SystemExit(f"gpu_levers.py: unknown model(s) {unknown}; known: "
                     f"{', '.join(every)}")
  models = [every[n] for n in chosen_names]
  if args_.quick:
    models = [(n, m, QUICK_SIZES[n]) for n, m, _ in models if n in QUICK_SIZES]
  rounds = 3 if args_.quick else args_.rounds
  result = {"machine": _common.machine(), "rounds": rounds, "cases": []}
  lines = [f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
           f"jax {jax.__version__}; {rounds} rounds; ratio = jax.jit (XLA "
           "defaults) / program, paired per round (> 1: faster)"]
  for name, model, size in models:
    make_fn, args = model(size, STREAMS, jax.random.PRNGKey(0))
    ways, chosen = compile_ways(
        make_fn, args, args_.ways.split(",") if args_.ways else None)
    reference = ways["jax.jit"]
    jax.block_until_ready(reference(*args))
    start = time.perf_counter()
    jax.block_until_ready(reference(*args))
    once_ms = (time.perf_counter() - start) * 1e3
    calls = max(1, min(500, int(args_.target_ms / max(once_ms, 1e-3))))
    for compiled in ways.values():
      jax.block_until_ready(compiled(*args))
    anchors, no_torch = torch_ways(name, size, args)
    checked = (anchor_check(reference(*args), anchors)
               if anchors and _TORCH[name] == "linen_dual_encoder" else {})
    for step in anchors.values():
      _torch_wait(step())
    runs = {w: sampler(functools.partial(c, *args), calls)
            for w, c in ways.items()}
    runs.update({w: sampler(step, calls, _torch_wait)
                 for w, step in anchors.items()})
    samples = _common.rounds(runs, rounds)
    case = {"model": name, "size": size, "calls_per_sample": calls,
            "default_chose": chosen, "ways": {},
            "pytorch": no_torch or "timed",
            "pytorch_max_difference_from_jax": checked}
    lines.append(f"\n{name} {size}\n  default chose {chosen['way']!r} "
                 f"(first call {chosen['first_call_s']:.2f} s, decided after "
                 f"{chosen['calls_to_decide']} calls, "
                 f"{chosen['decided_s']:.2f} s): "
                 f"{chosen['reason']}")
    for way, compiled in ways.items():
      text = compiled.as_text()
      ms = sorted(samples[way])[len(samples[way]) // 2]
      ratio = _common.paired(samples["jax.jit"], samples[way])
      entry = {"median_ms": ms, "ratio_vs_jax_jit": ratio,
               "samples_ms": samples[way],
               "call_starts": text.count("call-start("),
               "memory": memory(compiled)}
      line = f"  {way:32s} {ms:8.3f} ms  {ratio:6.3f}x"
      if "held_mb" in entry["memory"]:
        line += (f"  temp {entry['memory']['temp_mb']:8.1f} MB, held "
                 f"{entry['memory']['held_mb']:8.1f} MB")
      if args_.trace:
        entry["overlap"] = traced_overlap(compiled, args, min(calls, 20))
        share = entry["overlap"].get("overlapped_share")
        line += (f"  kernels overlapped {share:5.1%}" if share is not None
                 else f"  trace: {entry['overlap'].get('error')}")
      case["ways"][way] = entry
      lines.append(line)
    for way, step in anchors.items():
      ms = sorted(samples[way])[len(samples[way]) // 2]
      ratio = _common.paired(samples["jax.jit"], samples[way])
      entry = {"median_ms": ms, "ratio_vs_jax_jit": ratio,
               "samples_ms": samples[way],
               "memory": torch_peak(step, min(calls, 5))}
      line = f"  {way:32s} {ms:8.3f} ms  {ratio:6.3f}x"
      if entry["memory"]["peak_mb"] is not None:
        line += f"  peak {entry['memory']['peak_mb']:8.1f} MB"
      if args_.trace:
        entry["overlap"] = torch_overlap(step, min(calls, 20))
        line += ("  kernels overlapped "
                 f"{entry['overlap']['overlapped_share']:5.1%}")
      case["ways"][way] = entry
      lines.append(line)
    if no_torch is not None:
      lines.append(f"  (PyTorch anchors not run: {no_torch})")
    result["cases"].append(case)
  text = "\n".join(lines) + "\n"
  print(text)
  suffix = "_quick" if args_.quick else ""
  which = ("" if args_.models == "suite"
           else "_" + args_.models.replace(",", "+"))
  path = _common.save(args_.out, f"gpu_levers{which}_{jax.default_backend()}"
                      f"_jax{jax.__version__}{suffix}", result, text)
  print("saved", path)


if __name__ == "__main__":
  main()
