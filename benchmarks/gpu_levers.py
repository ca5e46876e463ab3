"""What XLA:GPU's options do to jaxstreams' regions, on a GPU.

The suite measured jaxstreams' stream calls slower than jax.jit on an H100
(jax 0.11.2), and its profiled regions ran one after the other. This script
times, in one run, each model's program compiled several ways, to tell which
lever matters:

* ``jax.jit`` with XLA's defaults (the reference), with command buffers off
  (``xla_gpu_enable_command_buffer=""``: no CUDA graphs), and with
  ``xla_gpu_command_buffer_scheduling_mode=CONCURRENT``;
* ``jaxstreams.jit`` with its default GPU lowering (``inline``: the program
  jax.jit builds), alone and with CONCURRENT;
* ``jaxstreams.jit`` with the ``streams`` lowering (each off-main region a
  call on its stream): with XLA's defaults, command buffers off, CONCURRENT,
  and without sequence points (``jaxstreams_sequence_points``).

Models: K independent chains of small matmuls (each chain on its own stream;
the case streams exist for), and the suite's Inception-style, DLRM-style and
MLP-bank models at one size each. Method: every program compiled ahead of
time; a sample is ``calls`` calls each ended by ``block_until_ready``;
``--rounds`` rounds in alternating order; reported: each program's median ms
and the paired ratio jax.jit (defaults) / program (above 1: faster). The
JSON records, per program, its call-start count and how many command-buffer
computations the compiled program holds.

  python benchmarks/gpu_levers.py [--rounds 15] [--quick] [--out DIR]
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from workloads import common, dlrm, inception, mlp_bank  # noqa: E402

import jaxstreams  # noqa: E402

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
      outs = [place(1 + i % (streams - 1), chain, x, w) for i, w in enumerate(ws)]
      return sum(o.astype(jnp.float32).sum() for o in outs)
    return f
  return make_fn, (ws, x)


MODELS = [
    ("chains", chains_model, dict(chains=4, depth=40, n=256, batch=8)),
    ("inception", inception.model, dict(batch=8, hw=17, channels=64, blocks=4)),
    ("dlrm", dlrm.model, dict(mode="train", towers=8, batch=256, vocab=4096,
                              dim=32, hot=4, hidden=128)),
    ("mlp_bank", mlp_bank.model, dict(models=8, batch=32, width=128, depth=3,
                                      d_in=64, d_out=8)),
]


def compile_ways(make_fn, args):
  """name -> compiled program, for every way this script compares."""
  plain = jax.jit(make_fn(common.place_none))
  ways = {
      "jax.jit": plain.lower(*args).compile(),
      "jax.jit, no command buffers": plain.lower(*args).compile(
          compiler_options=NO_COMMAND_BUFFERS),
      "jax.jit, CONCURRENT": plain.lower(*args).compile(
          compiler_options=common.CONCURRENT_OPTIONS),
  }
  inline = jaxstreams.jit(make_fn(common.place_jaxstreams), streams=STREAMS)
  ways["jaxstreams (default: inline)"] = inline.lower(*args).compile()
  ways["jaxstreams, inline, CONCURRENT"] = inline.lower(*args).compile(
      compiler_options=common.CONCURRENT_OPTIONS)
  calls = _stream_calls(make_fn, args, sequence_points=True)
  ways["jaxstreams, stream calls"] = calls.compile()
  ways["jaxstreams, stream calls, no command buffers"] = calls.compile(
      compiler_options=NO_COMMAND_BUFFERS)
  ways["jaxstreams, stream calls, CONCURRENT"] = calls.compile(
      compiler_options=common.CONCURRENT_OPTIONS)
  ways["jaxstreams, stream calls, no sequence points"] = _stream_calls(
      make_fn, args, sequence_points=False).compile()
  return ways


def _stream_calls(make_fn, args, sequence_points):
  """The model lowered with each off-main region a call on its stream
  (jaxstreams_sequence_points is read when the function is traced)."""
  jaxstreams.config.update("jaxstreams_sequence_points", sequence_points)
  try:
    return jaxstreams.jit(make_fn(common.place_jaxstreams), streams=STREAMS,
                          gpu_lowering="streams").lower(*args)
  finally:
    jaxstreams.config.reset("jaxstreams_sequence_points")


def sampler(compiled, args, calls):
  def sample():
    start = time.perf_counter()
    for _ in range(calls):
      jax.block_until_ready(compiled(*args))
    return (time.perf_counter() - start) / calls * 1e3
  return sample


def main():
  p = _common.parser(__doc__.splitlines()[0], "3 rounds, the chains model only")
  p.add_argument("--rounds", type=int, default=15)
  p.add_argument("--target-ms", type=float, default=20.0)
  args_ = p.parse_args()
  if jax.default_backend() != "gpu" and not args_.quick:
    raise SystemExit("gpu_levers.py measures XLA:GPU options: it needs a GPU "
                     "(--quick runs it anywhere, to check that it works)")
  models = MODELS[:1] if args_.quick else MODELS
  rounds = 3 if args_.quick else args_.rounds
  result = {"machine": _common.machine(), "rounds": rounds, "cases": []}
  lines = [f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
           f"jax {jax.__version__}; {rounds} rounds; ratio = jax.jit (XLA "
           "defaults) / program, paired per round (> 1: faster)"]
  for name, model, size in models:
    make_fn, args = model(size, STREAMS, jax.random.PRNGKey(0))
    ways = compile_ways(make_fn, args)
    reference = ways["jax.jit"]
    jax.block_until_ready(reference(*args))
    start = time.perf_counter()
    jax.block_until_ready(reference(*args))
    once_ms = (time.perf_counter() - start) * 1e3
    calls = max(1, min(500, int(args_.target_ms / max(once_ms, 1e-3))))
    for compiled in ways.values():
      jax.block_until_ready(compiled(*args))
    samples = _common.rounds(
        {w: sampler(c, args, calls) for w, c in ways.items()}, rounds)
    case = {"model": name, "size": size, "calls_per_sample": calls, "ways": {}}
    lines.append(f"\n{name} {size}")
    for way, compiled in ways.items():
      text = compiled.as_text()
      ms = sorted(samples[way])[len(samples[way]) // 2]
      ratio = _common.paired(samples["jax.jit"], samples[way])
      case["ways"][way] = {
          "median_ms": ms, "ratio_vs_jax_jit": ratio, "samples_ms": samples[way],
          "call_starts": text.count("call-start("),
          "command_buffers": text.count("command_buffer")}
      lines.append(f"  {way:46s} {ms:8.3f} ms  {ratio:6.3f}x  call-starts "
                   f"{text.count('call-start('):3d}  command-buffer mentions "
                   f"{text.count('command_buffer'):3d}")
    result["cases"].append(case)
  text = "\n".join(lines) + "\n"
  print(text)
  suffix = "_quick" if args_.quick else ""
  path = _common.save(args_.out, f"gpu_levers_{jax.default_backend()}_jax"
                      f"{jax.__version__}{suffix}", result, text)
  print("saved", path)


if __name__ == "__main__":
  main()
