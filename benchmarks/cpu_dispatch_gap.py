"""What host work between two steps costs a loop of short steps on XLA:CPU
that reads every result: why anything that hands out batches from Python
(``prefetch``'s inline way, a bare generator, a user's own loader) loses
more at 0.1 ms steps than its own few microseconds.

The loop is prefetch_sweep's: the 0.1 ms step (``--step-ms``), a numpy batch
per step, ``float(loss)`` every step. Between reading one result and
dispatching the next step the host spins for ``gap`` microseconds (pure
Python, nothing touching jax): the stand-in for an iterator's per-item work.
Reported per gap: the time per step, and the *extra*, that time less the
gap less the time per step at gap 0: what the gap cost beyond itself.

Run twice, in two processes: XLA:CPU's default asynchronous dispatch, and
``jax_cpu_enable_async_dispatch=False`` (the computation runs in the calling
thread; the option is read when the CPU client starts, so once per
process). A positive extra under asynchronous dispatch only is what the
hand-off to XLA's thread pool costs once the host has been away for a few
microseconds (what it is inside XLA, a pool thread that stopped spinning and
has to be woken, is the likely reading; this script shows the cost, not its
cause).

Method (``_common.py``): ``--rounds`` rounds, each runs every gap once over
``--steps`` steps in alternating order; the median per gap. Saves
benchmarks/results/<device>/jax<version>/cpu_dispatch_gap_<platform>_jax<version>[_quick].json
and .txt.

  python benchmarks/cpu_dispatch_gap.py [--quick] [--steps 400] [--rounds 15]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GAPS_US = (0, 1, 2, 3, 4, 5, 6, 8, 12, 20, 40)


def spin(us: float) -> None:
  end = time.perf_counter() + us * 1e-6
  while time.perf_counter() < end:
    pass


def measure(sync_dispatch: bool, step_ms: float, steps: int,
            rounds: int) -> dict:
  """This process's figures, with dispatch as asked (run in a fresh
  process: the option must be set before the CPU client starts)."""
  import jax
  if sync_dispatch:
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  import jax.numpy as jnp
  import numpy as np
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _common
  import prefetch_sweep

  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32)
  iters, _ = prefetch_sweep.calibrate(w, jnp.ones((16, 32)), step_ms)
  step = jax.jit(prefetch_sweep.make_step(iters))
  batches = [rng.standard_normal((16, 32)).astype(np.float32)
             for _ in range(steps)]

  def loop(gap_us):
    def run():
      t0 = time.perf_counter()
      for b in batches:
        if gap_us:
          spin(gap_us)
        float(step(w, b))
      return (time.perf_counter() - t0) / steps
    return run

  loop(0)()                                     # compile, warm
  samples = _common.rounds({g: loop(g) for g in GAPS_US}, rounds)
  per_step = {g: statistics.median(v) * 1e6 for g, v in samples.items()}
  base = per_step[0]
  return {"machine": _common.machine(), "iters": iters,
          "per_step_us": {str(g): per_step[g] for g in GAPS_US},
          "extra_us": {str(g): per_step[g] - g - base for g in GAPS_US},
          "samples_s": {str(g): samples[g] for g in GAPS_US}}


def main():
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _common
  parser = _common.parser(__doc__.splitlines()[0],
                          quick="150 steps x 5 rounds")
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--step-ms", type=float, default=0.1)
  parser.add_argument("--child", choices=("async", "sync"),
                      help=argparse.SUPPRESS)   # internal: one dispatch mode
  args = parser.parse_args()
  if args.quick:
    args.steps, args.rounds = 150, 5
  if args.child:
    result = measure(args.child == "sync", args.step_ms, args.steps,
                     args.rounds)
    print(json.dumps(result))
    return

  runs = {}
  for dispatch in ("async", "sync"):
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", dispatch,
         "--steps", str(args.steps), "--rounds", str(args.rounds),
         "--step-ms", str(args.step_ms)],
        check=True, capture_output=True, text=True)
    runs[dispatch] = json.loads(out.stdout.strip().splitlines()[-1])
  info = runs["async"]["machine"]
  header = (f"{'gap us':>6} | {'async: us/step':>14} {'extra us':>8} | "
            f"{'sync: us/step':>13} {'extra us':>8}")
  lines = [f"# {info['device_kind']} ({info['platform']}), jax {info['jax']}, "
           f"{info['cpu_cores']} cores; {args.step_ms} ms step read every "
           f"step; {args.rounds} rounds x {args.steps} steps, median; extra = "
           f"time per step - gap - time per step at gap 0", header]
  for g in GAPS_US:
    a, s = runs["async"], runs["sync"]
    lines.append(f"{g:>6} | {a['per_step_us'][str(g)]:>14.1f} "
                 f"{a['extra_us'][str(g)]:>8.1f} | "
                 f"{s['per_step_us'][str(g)]:>13.1f} "
                 f"{s['extra_us'][str(g)]:>8.1f}")
  text = "\n".join(lines) + "\n"
  print(text, end="")
  result = {"benchmark": "cpu_dispatch_gap", "machine": info,
            "quiet_machine": args.quiet, "quick": args.quick,
            "step_ms_target": args.step_ms, "steps": args.steps,
            "rounds": args.rounds, "gaps_us": list(GAPS_US),
            "async_dispatch": runs["async"], "sync_dispatch": runs["sync"],
            "load_average_at_end": _common.load()}
  name = f"cpu_dispatch_gap_{info['platform']}_jax{info['jax']}" + (
      "_quick" if args.quick else "")
  print(f"saved {_common.save(args.out, name, result, text)} and .txt")


if __name__ == "__main__":
  main()
