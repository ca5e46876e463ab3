"""Never slower than doing without: prefetch and staged against the plain
loop, for steps from 0.1 ms to 10 ms, with and without a per-step read.

The step is a jitted function whose time is calibrated (a chain of small
matmuls repeated with ``lax.fori_loop``) to about 0.1, 0.3, 1, 3 and 10 ms.
Producers:

* ``free`` (every step size): host numpy batches made in advance, so there
  is nothing to hide and what is measured is each path's own cost (the
  case ``prefetch`` and ``staged`` must not lose in: goal within 3%);
* ``io`` (1, 3 and 10 ms steps; ``--producers`` to choose): each batch
  waits as long as a step before it is handed over (``time.sleep``: a
  storage read), the case prefetching is for.

Loops, in the same run:

* ``plain``: ``for b in data: out = step(w, b)``;
* ``prefetch``: the same loop over ``jaxstreams.prefetch(data)``, the
  default ``mode="measured"`` (the JSON records the way it chose);
* ``workers``: over ``jaxstreams.prefetch(data, mode="workers")``, worker
  threads always (what ``measured`` steps aside from, for reference);
* ``workers16``: the same with ``size=16`` (a longer lookahead: more room
  for a worker's late wake-ups);
* ``measured16``: ``jaxstreams.prefetch(data, size=16)``, the default mode
  with that lookahead;
* ``staged``: ``jaxstreams.staged(step, data=data)`` with the batch's
  preprocessing in ``jaxstreams.stage(...)``, called once per batch: the
  default ``mode="measured"`` (the JSON records the way it chose, and its
  trials);
* ``fused``: the same with ``mode="fused"``, staged always (what
  ``measured`` steps aside from, for reference);
* ``bare``: the plain loop over a generator that places each batch with
  the call prefetch places items with and does nothing else: the least any
  Python-level iterator handing out device arrays costs, for reference.

"read" means the loop reads each step's result (``float(loss)``), so the
host waits for the device every step (the usual loop that logs its loss);
"no read" reads only the last result.

Method (benchmarks/_common.py): per case, ``--rounds`` rounds (three times
as many for steps under 1 ms, whose rounds scatter most: per-round ratios
of 0.8x to 1.1x at 0.1 ms on the shared 2-core machine); a round runs
each loop once over all ``--steps`` batches (for steps under 1 ms, as many
as take about as long: ``--steps`` / step ms, 4000 at 0.1 ms; a fifth at
10 ms), in alternating order. Reported:
each loop's median time per step, and per loop the median over rounds of
plain's time over its time in the same round (the paired ratio; above 1 is
faster than the plain loop). The load average is recorded per case. Saves
benchmarks/results/<device>/jax<version>/prefetch_sweep_<platform>[_quick].json
and .txt.

``--cpu-sync-dispatch`` runs XLA:CPU computations in the calling thread
(``jax_cpu_enable_async_dispatch=False``, set before the backend starts);
its results are saved with ``_sync_dispatch`` in their name.

``--step-ms 0.1,0.3`` runs only those of the step sizes (so that a session
with a time limit per command, such as a lent GPU's, can run the sweep in
parts); a part is saved with the steps in its name
(``prefetch_sweep_gpu_steps0.1-0.3``).

  python benchmarks/prefetch_sweep.py [--quick] [--steps 400] [--rounds 7]
      [--producers free,io] [--step-ms 0.1,0.3,1,3,10] [--cpu-sync-dispatch]
      [--quiet] [--out DIR]
"""

import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxstreams  # noqa: E402
import _common  # noqa: E402

STEP_MS = (0.1, 0.3, 1.0, 3.0, 10.0)
IO_STEP_MS = (1.0, 3.0, 10.0)      # steps the io producer is run with
SHORT_STEP_ROUNDS = 3              # rounds x this under 1 ms steps
GOAL = 0.97                        # free producer: prefetch, staged / plain


def make_step(iters):
  def step(w, batch):
    x = jaxstreams.stage(jnp.tanh(batch * 0.5))    # data-only preprocessing

    def body(_, h):
      return jnp.tanh(h @ w)

    h = jax.lax.fori_loop(0, iters, body, x)
    return jnp.mean(h * h)
  return step


def _ms_per_step(w, batch, iters, batches=5, batch_s=0.01):
  """The step's time in a loop like the sweep's (each result read before
  the next call), after a warm-up: the median over ``batches`` runs of
  back-to-back calls lasting about ``batch_s`` each. Single calls timed
  apart measured a 1-iteration step at 25 to 86 us across processes on the
  2-core machine (threads waking from idle); a median of loops does not
  lean on one wake-up, and a median, not a mean, rides out load bursts."""
  f = jax.jit(make_step(iters))
  f(w, batch).block_until_ready()
  calls, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < batch_s:      # warm-up; also sizes a run
    f(w, batch).block_until_ready()
    calls += 1
  times = []
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(calls):
      f(w, batch).block_until_ready()
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times) * 1e3


def calibrate(w, batch, target_ms, tolerance=0.1, checks=5):
  """Iterations of the loop body giving a step of about ``target_ms``, and
  the step time measured at that count. A first guess from the line
  through 1 and 256 iterations; then each guess is timed, and the next one
  interpolated between the timed counts nearest the target from below and
  above (the largest count timed short and the smallest timed long; or
  along the first line when the target is not yet bracketed),
  until one is within ``tolerance`` of the target (at most ``checks``
  times). What is returned was timed: the count timed closest to the
  target. A load burst while one point was timed put a "0.3 ms" step at
  0.1 ms in one run (2-core machine) without the check, and correcting from
  a mistimed 1-iteration point, then returning the last correction
  untimed, put a "0.1 ms" step at 33 us in another. Still only roughly:
  on that machine one process timed the same step at 0.79 to 1.23 ms in
  consecutive measurements, which is why each row records the plain
  loop's own time per step."""
  timed = {1: _ms_per_step(w, batch, 1),
           256: _ms_per_step(w, batch, 256)}
  per_iter = max((timed[256] - timed[1]) / 255, 1e-6)
  iters = max(1, round(1 + (target_ms - timed[1]) / per_iter))
  for _ in range(checks):
    if iters not in timed:
      timed[iters] = _ms_per_step(w, batch, iters)
    if abs(timed[iters] - target_ms) <= tolerance * target_ms:
      break
    below = [n for n, ms in timed.items() if ms < target_ms]
    above = [n for n, ms in timed.items() if ms > target_ms]
    if not below:                  # one iteration already takes too long
      break
    lo = max(below)                # the bracket: counts, not times, so
    hi = min(above) if above else None     # one mistimed point drops out
    if hi is not None and hi > lo + 1:
      iters = round(lo + (hi - lo) * (target_ms - timed[lo])
                    / (timed[hi] - timed[lo]))
    elif hi is None:
      iters = max(lo + 1, round(lo + (target_ms - timed[lo]) / per_iter))
    else:                          # bracketed by neighbours (or noise)
      break
    if iters in timed:             # no new count to time
      break
  iters = min(timed, key=lambda n: abs(timed[n] - target_ms))
  return iters, timed[iters]


def run_plain(step, w, data, read):
  out = None
  for b in data:
    out = step(w, b)
    if read:
      float(out)
  return float(out)


def run_prefetch(step, w, data, read, mode="measured", size=2):
  """The plain loop, fed by ``jaxstreams.prefetch`` instead of the data;
  returns its result and the iterator's stats."""
  with jaxstreams.prefetch(data, size, mode=mode) as it:
    return run_plain(step, w, it, read), it.stats()


def _any_dtype(dtype):
  return True      # the batches are float32: nothing to convert


def bare(data):
  """Each batch placed as prefetch places it, by a bare generator."""
  place = jaxstreams._compat.host_array_to_device   # noqa: SLF001
  for b in data:
    yield place(b, _any_dtype)


def run_staged(step, w, data, read, steps, mode="measured"):
  """The loop over ``jaxstreams.staged``; returns its result and the
  runner's stats."""
  out = None
  with jaxstreams.staged(step, data=data, mode=mode) as runner:
    for _ in range(steps):
      out = runner(w)
      if read:
        float(out)
    return float(out), runner.stats()


def source(batches, io_ms):
  """The batches; with ``io_ms``, each waits that long first (a read)."""
  if not io_ms:
    return batches

  def read():
    for b in batches:
      time.sleep(io_ms / 1e3)
      yield b
  return read()


LOOPS = ("plain", "prefetch", "workers", "workers16", "measured16", "staged",
         "fused", "bare")


def _choice(stats):
  """What a default (measured) mode chose, from its stats."""
  return {"mode": stats["mode"], "switches": stats["switches"],
          "trials": stats["trials"], "reason": stats["mode_reason"]}


def measure(step, w, batches, read, io_ms, rounds):
  """One case: the loops' samples (seconds per step) and what prefetch's
  and staged's default modes chose (in the last round)."""
  steps = len(batches)
  results, chose = {}, {}

  def sample(name):
    def run():
      data = source(batches, io_ms)
      t0 = time.perf_counter()
      if name == "plain":
        results[name] = run_plain(step, w, data, read)
      elif name == "bare":
        results[name] = run_plain(step, w, bare(data), read)
      elif name in ("prefetch", "workers", "workers16", "measured16"):
        mode = "workers" if name.startswith("workers") else "measured"
        size = 16 if name.endswith("16") else 2
        results[name], stats = run_prefetch(step, w, data, read, mode, size)
        if mode == "measured":
          chose[name] = _choice(stats)
      else:
        mode = "measured" if name == "staged" else "fused"
        results[name], stats = run_staged(step, w, data, read, steps, mode)
        if name == "staged":
          chose["staged"] = _choice(stats)
      return (time.perf_counter() - t0) / steps
    return run

  samples = _common.rounds({name: sample(name) for name in LOOPS}, rounds)
  assert len(set(results.values())) == 1, results   # the same loss
  return samples, chose


def main():
  parser = _common.parser(
      __doc__.splitlines()[0],
      quick="150 steps (1500 at 0.1 ms, 30 at 10 ms) x 3 rounds")
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--producers", default="free,io")
  parser.add_argument("--step-ms", default=None,
                      help="comma-separated step sizes, of "
                           + ",".join(f"{ms:g}" for ms in STEP_MS))
  parser.add_argument("--cpu-sync-dispatch", action="store_true",
                      help="jax_cpu_enable_async_dispatch=False")
  args = parser.parse_args()
  if args.cpu_sync_dispatch:     # read when the CPU client is made: first
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  if args.quick:
    args.steps, args.rounds = 150, 3
  producers = args.producers.split(",")
  step_ms = STEP_MS
  if args.step_ms is not None:
    try:
      step_ms = tuple(float(ms) for ms in args.step_ms.split(","))
    except ValueError:
      step_ms = ()
    if not step_ms or not set(step_ms) <= set(STEP_MS):
      parser.error(f"--step-ms: a comma-separated list of "
                   f"{', '.join(f'{ms:g}' for ms in STEP_MS)}, got "
                   f"{args.step_ms!r}")

  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32)
  batch_shape = (16, 32)
  info = _common.machine()
  print(f"device: {info['device_kind']} ({info['platform']}), jax "
        f"{info['jax']}, {info['cpu_cores']} cores, load "
        f"{info['load_average_at_start']}; {args.rounds} rounds ("
        f"{args.rounds * SHORT_STEP_ROUNDS} under 1 ms), median; "
        f"ratio = plain / loop, paired per round (> 1: faster)")
  header = (f"{'step':>7} {'producer':>8} {'read':>4} {'plain us':>9} "
            + " ".join(f"{name:>9}" for name in LOOPS[1:])
            + "   prefetch, measured16, staged chose")
  print(header)
  rows, lines = [], [header]
  for target in step_ms:
    iters, calibrated_ms = calibrate(w, jnp.ones(batch_shape), target)
    step = jax.jit(make_step(iters))
    # Loops of about the same length in time under 1 ms (4000 steps of
    # 0.1 ms by default): a few hundred steps is too short a loop for a
    # trial's windows to be a small part of it.
    steps = (max(args.steps, round(args.steps / target)) if target < 1
             else args.steps if target < 10 else max(30, args.steps // 5))
    batches = [rng.standard_normal(batch_shape).astype(np.float32)
               for _ in range(steps)]
    for producer in producers:
      if producer == "io" and target not in IO_STEP_MS:
        continue
      io_ms = target if producer == "io" else 0.0
      for read in (True, False):
        with warnings.catch_warnings():   # the step-aside notice: expected
          warnings.simplefilter("ignore", jaxstreams.PerformanceWarning)
          measure(step, w, batches[:8], read, 0.0, 1)   # compile, warm
          load_before = _common.load()
          rounds = args.rounds * (SHORT_STEP_ROUNDS if target < 1 else 1)
          samples, chose = measure(step, w, batches, read, io_ms, rounds)
        median = {name: statistics.median(v) for name, v in samples.items()}
        ratios = {name: _common.paired(samples["plain"], samples[name])
                  for name in LOOPS[1:]}
        row = {"step_ms_target": target, "iters": iters,
               "step_ms_calibrated": calibrated_ms, "rounds": rounds,
               "producer": producer, "io_ms": io_ms,
               "read_every_step": read, "steps": steps,
               "seconds_per_step_median": median,
               "seconds_per_step_samples": samples,
               "paired_ratio_to_plain": ratios,
               "prefetch_measured": chose["prefetch"],
               "prefetch_measured_size16": chose["measured16"],
               "staged_measured": chose["staged"],
               "load_average_before": load_before,
               "load_average_after": _common.load()}
        if producer == "free":
          row["prefetch_meets_goal"] = ratios["prefetch"] >= GOAL
          row["staged_meets_goal"] = ratios["staged"] >= GOAL
        rows.append(row)
        line = (f"{target:>5.1f}ms {producer:>8} {'yes' if read else 'no':>4} "
                f"{median['plain'] * 1e6:>9.0f} "
                + " ".join(f"{ratios[name]:>8.3f}x" for name in LOOPS[1:])
                + "   " + ", ".join(
                    f"{c['mode']} ({c['switches']} switches, "
                    f"{len(c['trials'])} trials)"
                    for c in (chose["prefetch"], chose["measured16"],
                              chose["staged"])))
        print(line, flush=True)
        lines.append(line)

  result = {"benchmark": "prefetch_sweep", "machine": info,
            "load_average_at_end": _common.load(),
            "quiet_machine": args.quiet, "quick": args.quick,
            "cpu_sync_dispatch": args.cpu_sync_dispatch,
            "steps": args.steps, "rounds": args.rounds,
            "step_ms": list(step_ms),
            "goal_free_producer_over_plain": GOAL, "rows": rows,
            "note": ("paired_ratio_to_plain: median over rounds of plain's "
                     "time per step over the loop's in the same round; "
                     "noisy unless the machine was quiet (see quiet_machine "
                     "and the load averages)")}
  name = (f"prefetch_sweep_{info['platform']}"
          + ("_sync_dispatch" if args.cpu_sync_dispatch else "")
          + ("" if step_ms == STEP_MS else
             "_steps" + "-".join(f"{ms:g}" for ms in step_ms))
          + ("_quick" if args.quick else ""))
  text = (f"# {'quiet' if args.quiet else 'not marked quiet'}; load at start "
          f"{info['load_average_at_start']}, at end "
          f"{result['load_average_at_end']}; {args.rounds} rounds "
          f"({args.rounds * SHORT_STEP_ROUNDS} under 1 ms) x "
          f"{args.steps} steps\n" + "\n".join(lines) + "\n")
  print(f"saved {_common.save(args.out, name, result, text)} and .txt")


if __name__ == "__main__":
  main()
