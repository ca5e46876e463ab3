"""Fits the step-time estimate's constants to the step times an H100 measured.

``jaxstreams.xla.step_time`` estimates a compiled program's GPU step from
what XLA launches; what launching and running cost (``LaunchCosts``) is
fitted here to ``benchmarks/gpu_levers.py``'s runs on an H100 (jax
0.11.2): six models, each compiled the ways that script times (``jax.jit``
with XLA's defaults, with CONCURRENT graphs and without command buffers,
and ``jaxstreams.jit`` forced to ``inline``, ``concurrent``, ``streams``
and ``streams_concurrent``).

Two steps:

* ``--compile``: each model compiled every way for an H100, without one
  (one child process per model), and what it launches kept as plain data
  (``GpuProgram.to_json``) in ``benchmarks/results/h100/jax<version>/
  step_time_programs_h100_jax<version>.json``. Needs the CUDA plugin.
* the fit (always): the measured figures (``MEASURED``: each way's paired
  ratio to ``jax.jit`` and ``jax.jit``'s median time, averaged over the
  runs) and the programs, the constants that minimise the squared log
  error of each way's ratio (and, with a smaller weight, of ``jax.jit``'s
  time), by Nelder-Mead from several starts; written to
  ``jaxstreams/xla/fitted_costs.py``, with each way's error to
  ``benchmarks/results/h100/jax<version>/step_time_fit_h100_jax<version>.txt``.

To refit (new runs, a new jax): add the runs' result files to
``MEASURED``, then ``python benchmarks/fit_step_time.py --compile`` under
the jax the runs used; ``tests/test_step_time.py`` holds every jax's
estimate to the figures.

  python benchmarks/fit_step_time.py [--compile] [--no-write] [--evaluate]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FITTED = ROOT / "jaxstreams" / "xla" / "fitted_costs.py"

# The H100 runs the constants are fitted to (gpu_levers.py --trace, jax
# 0.11.2: the second GPU session's, now archived, and the third's, the
# current ones; the first session's timed ways under other names, before
# the ways had their present form, and is left out).
MEASURED = ("archive/h100-jax0.11.2-session2/gpu_levers_gpu_jax0.11.2.json",
            "h100/jax0.11.2/gpu_levers_gpu_jax0.11.2.json",
            "h100/jax0.11.2/gpu_levers_two_candidates_gpu_jax0.11.2.json")
REFERENCE = "jax.jit"
# The fastest way counts as named where the way estimated fastest ran within
# this share of the fastest measured (the runs' spread of a way's ratio).
NOISE = 0.03
# gpu_levers.py's names of the ways, and how each is compiled here.
WAYS = {
    "jax.jit": dict(plain=True),
    "jax.jit, CONCURRENT": dict(plain=True, concurrent=True),
    "jax.jit, no command buffers": dict(plain=True, no_graphs=True),
    "jaxstreams inline": dict(way="inline"),
    "jaxstreams concurrent": dict(way="concurrent"),
    "jaxstreams streams": dict(way="streams"),
    "jaxstreams streams_concurrent": dict(way="streams_concurrent"),
}
# Fitted constants, their first guesses (seconds) and bounds.
START = {"call": 25e-6, "argument": 0.5e-6, "result": 2e-6, "graph": 5e-6, "graph_node": 0.3e-6,
         "graph_library": 5e-6, "kernel": 5e-6, "library": 8e-6, "stream_call": 4e-6,
         "loop_step": 2e-6, "host_wait": 10e-6, "kernel_time": 1.5e-6,
         "graph_latency": 1e-6, "graph_issue": 0.5e-6, "stream_latency": 1e-6,
         "efficiency": 0.3}
# No run has a loop or a conditional outside the graphs: these two follow
# from fitted ones. A loop of known trip count runs its body's launches again
# each step (its counter's update is a kernel of the body, counted there):
# nothing more. Waiting for the device's predicate or branch index is a copy
# launched like a kernel, and the wait itself, which the play counts.
DERIVED = {"loop_step": lambda fitted: 0.0,
           "host_wait": lambda fitted: fitted["kernel"]}
FIXED = set(DERIVED)
BOUNDS = {k: (1e-9, 1e-3) for k in START}
BOUNDS["efficiency"] = (0.01, 1.0)


def result_file(kind: str, jax_version: str, suffix: str = "txt") -> pathlib.Path:
  """``results/h100/jax<version>/step_time_<kind>_h100_jax<version>``: the
  compiled programs, the fit or the committed constants' errors, beside the
  other figures of an H100 and that jax."""
  return (RESULTS / "h100" / f"jax{jax_version}"
          / f"step_time_{kind}_h100_jax{jax_version}.{suffix}")


def comparable_ways() -> dict:
  """The ways whose programs on the installed jax are the ones the H100
  ran: before jaxlib 0.12 XLA chains stream calls in its graphs; jaxlib
  0.12 forks them, a program no GPU has timed (and whose graphs XLA's log
  cuts too short to read, for the DLRM-style step)."""
  from jaxstreams import _compat
  if _compat.XLA_SCHEDULES_STREAM_CALLS:
    return {w: how for w, how in WAYS.items()
            if not how.get("way", "").startswith("streams")}
  return dict(WAYS)


def measured() -> dict:
  """Per model: each way's ratio to jax.jit (mean over the runs, and the
  runs'), and jax.jit's median time in seconds (mean over the runs)."""
  found: dict = {}
  for name in MEASURED:
    data = json.loads((RESULTS / name).read_text())
    for case in data["cases"]:
      entry = found.setdefault(case["model"], {"ratios": {}, "reference_s": []})
      entry["reference_s"].append(case["ways"][REFERENCE]["median_ms"] * 1e-3)
      for way, row in case["ways"].items():
        if way in WAYS and way != REFERENCE:
          entry["ratios"].setdefault(way, []).append(row["ratio_vs_jax_jit"])
  return {model: {"ratio": {w: statistics.mean(r) for w, r in e["ratios"].items()},
                  "runs": e["ratios"],
                  "reference_s": statistics.mean(e["reference_s"])}
          for model, e in found.items()}


def compile_programs(out: pathlib.Path) -> None:
  """Every model of gpu_levers.py compiled every way for an H100 without
  one; what each launches, as plain data."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples")]
  import jax
  import step_time_models
  programs = {}
  for name in step_time_models.NAMES:
    views = step_time_models.compile_model(name, comparable_ways())
    programs[name] = {way: view.program.to_json() for way, view in views.items()}
    print(name, {w: v.summary().splitlines()[0] for w, v in views.items()},
          flush=True)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"jax": jax.__version__, "target": "h100",
                             "programs": programs}))
  print("saved", out)


def predict(programs: dict, costs, device) -> dict:
  """Per model and way, the estimated step in seconds."""
  from jaxstreams.xla.launches import GpuProgram
  from jaxstreams.xla.step_time import estimate_step
  found = {}
  for model, ways in programs.items():
    found[model] = {}
    for way, data in ways.items():
      program = data if isinstance(data, GpuProgram) else GpuProgram.from_json(data)
      found[model][way] = estimate_step(program, costs, device,
                                        device_path=False).step
  return found


def errors(predicted: dict, figures: dict) -> dict:
  """Per model and way, the estimated ratio to jax.jit over the measured
  one, less 1; for jax.jit, its estimated time over the measured one."""
  found = {}
  for model, steps in predicted.items():
    row = {REFERENCE: steps[REFERENCE] / figures[model]["reference_s"] - 1}
    for way, ratio in figures[model]["ratio"].items():
      if way in steps:
        row[way] = (steps[REFERENCE] / steps[way]) / ratio - 1
    found[model] = row
  return found


def ranking(steps: dict, figures: dict) -> tuple[str, str, bool]:
  """For one model, among the ways both estimated and measured: the way
  estimated fastest (``steps``: way -> estimated step), the way measured
  fastest (``figures``: the model's entry of ``measured()``), and whether
  the first ran within ``NOISE`` of the second (the fastest way named)."""
  ran = dict(figures["ratio"], **{REFERENCE: 1.0})
  ran = {w: r for w, r in ran.items() if w in steps}
  estimated = min(ran, key=lambda w: steps[w])
  fastest = max(ran, key=ran.get)
  return estimated, fastest, ran[estimated] >= ran[fastest] * (1 - NOISE)


def fit(programs: dict, figures: dict, device, starts: int = 4):
  import numpy as np
  from scipy.optimize import minimize
  from jaxstreams.xla.launches import GpuProgram
  from jaxstreams.xla.step_time import LaunchCosts
  parsed = {m: {w: GpuProgram.from_json(d) for w, d in ways.items()}
            for m, ways in programs.items()}
  free = [k for k in START if k not in FIXED]
  low = np.log([BOUNDS[k][0] for k in free])
  high = np.log([BOUNDS[k][1] for k in free])

  def costs_of(x):
    values = dict(START)
    values.update({k: float(math.exp(v)) for k, v in zip(free, np.clip(x, low, high))})
    values.update({k: rule(values) for k, rule in DERIVED.items()})
    return LaunchCosts(**values)

  def loss(x):
    found = errors(predict(parsed, costs_of(x), device), figures)
    total = 0.0
    for model, row in found.items():
      for way, error in row.items():
        weight = 0.25 if way == REFERENCE else 1.0
        total += weight * math.log1p(error) ** 2
    return total + 10 * float(np.sum(np.maximum(0, np.abs(x - np.clip(x, low, high)))))

  rng = np.random.default_rng(0)
  x0 = np.log([START[k] for k in free])
  best = None
  for attempt in range(starts):
    start = x0 if attempt == 0 else x0 + rng.normal(0, 0.7, len(x0))
    result = minimize(loss, start, method="Nelder-Mead",
                      options={"maxiter": 3000, "xatol": 1e-3, "fatol": 1e-6})
    if best is None or result.fun < best.fun:
      best = result
    print(f"start {attempt}: loss {result.fun:.4f}", flush=True)
  return costs_of(best.x), best.fun


def report(costs, predicted, figures, jax_version: str, loss: float) -> str:
  how = (f"fitted to them, loss {loss:.4f} (sum of squared log errors)"
         if loss is not None else "the committed constants (not refitted)")
  lines = [f"Step-time estimate against the H100 runs ({', '.join(MEASURED)}); "
           f"programs compiled for an H100 without one, jax {jax_version}; "
           f"{how}.",
           "Per model: each way's ratio to jax.jit, estimated / measured "
           "(mean of the runs, their spread), and the error; jax.jit's time.", ""]
  found = errors(predicted, figures)
  for model, row in found.items():
    steps = predicted[model]
    lines.append(f"{model}: jax.jit estimated {steps[REFERENCE] * 1e6:.0f} us, "
                 f"measured {figures[model]['reference_s'] * 1e6:.0f} us "
                 f"({row[REFERENCE]:+.0%})")
    for way, ratio in figures[model]["ratio"].items():
      if way not in steps:
        continue
      runs = figures[model]["runs"][way]
      estimated = steps[REFERENCE] / steps[way]
      lines.append(f"  {way:32s} {estimated:5.2f}x / {ratio:5.2f}x "
                   f"({min(runs):.2f}-{max(runs):.2f})  {row[way]:+6.1%}")
    fastest_estimated, fastest, named = ranking(steps, figures[model])
    ran = dict(figures[model]["ratio"], **{REFERENCE: 1.0})
    lines.append(f"  fastest: estimated {fastest_estimated!r} (ran "
                 f"{ran[fastest_estimated]:.2f}x), measured "
                 f"{fastest!r} ({ran[fastest]:.2f}x): "
                 + ("named" if named else "missed")
                 + f" (within {NOISE:.0%}, the runs' noise)")
  lines += ["", "constants (us; efficiency: share of the peaks):"]
  for key, value in sorted(vars(costs).items()):
    lines.append(f"  {key:16s} {value if key == 'efficiency' else value * 1e6:.3f}"
                 + ("  (not fitted: no run has it; see DERIVED)" if key in FIXED
                    else ""))
  return "\n".join(lines) + "\n"


def write_constants(costs, jax_version: str) -> None:
  values = ",\n".join(f"    {k}={v!r}" for k, v in vars(costs).items())
  runs = "".join(f"\n* ``benchmarks/results/{name}``" for name in MEASURED)
  FITTED.write_text(f'''"""The step-time estimate's constants (``step_time.LaunchCosts``), fitted
to H100 runs by ``benchmarks/fit_step_time.py`` from programs compiled on
jax {jax_version}. Do not edit by hand: refit (see that script). Runs:
{runs}
"""

from jaxstreams.xla.step_time import LaunchCosts

H100 = LaunchCosts(
{values})
''')
  print("wrote", FITTED)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--compile", action="store_true",
                      help="compile the models first (needs the CUDA plugin)")
  parser.add_argument("--programs", default=None,
                      help="the compiled programs (default: this jax's file)")
  parser.add_argument("--no-write", action="store_true",
                      help="print the fit, write nothing")
  parser.add_argument("--evaluate", action="store_true",
                      help="no fit: the committed constants' errors on these "
                      "programs (another jax's, say), saved as "
                      "step_time_estimate_h100_jax<version>.txt")
  args = parser.parse_args(argv)
  sys.path.insert(0, str(ROOT))
  import jax
  path = pathlib.Path(args.programs or result_file("programs", jax.__version__,
                                                   "json"))
  if args.compile:
    compile_programs(path)
  data = json.loads(path.read_text())
  from jaxstreams.xla import target
  from jaxstreams.xla.step_time import Device
  device = Device.of("h100", target.BUILTIN_TARGETS["h100"])
  figures = measured()
  if args.evaluate:
    from jaxstreams.xla import fitted_costs
    text = report(fitted_costs.H100, predict(data["programs"], fitted_costs.H100,
                                             device), figures, data["jax"], None)
    print(text)
    if not args.no_write:
      result_file("estimate", data["jax"]).write_text(text)
    return 0
  costs, loss = fit(data["programs"], figures, device)
  text = report(costs, predict(data["programs"], costs, device), figures,
                data["jax"], loss)
  print(text)
  if not args.no_write:
    result_file("fit", data["jax"]).write_text(text)
    write_constants(costs, data["jax"])
  return 0


if __name__ == "__main__":
  sys.exit(main())
