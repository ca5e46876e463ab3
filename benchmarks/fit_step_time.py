"""Fits the step-time estimate's constants to the step times an H100 measured.

``jaxstreams.xla.step_time`` estimates a compiled program's GPU step from
what XLA launches; what launching and running cost (``LaunchCosts``) is
fitted here to ``benchmarks/gpu_levers.py``'s runs on an H100 (jax
0.11.2): six models, each compiled the ways that script times (``jax.jit``
with XLA's defaults, with CONCURRENT graphs and without command buffers,
and ``jaxstreams.jit`` forced to ``inline``, ``concurrent``, ``streams``
and ``streams_concurrent``).

Three steps:

* ``--compile``: each model compiled every way for an H100, without one
  (one child process per model), and what it launches kept as plain data
  (``GpuProgram.to_json``) in ``benchmarks/results/h100/jax<version>/
  step_time_programs_h100_jax<version>.json``. Needs the CUDA plugin.
* the fit (always): the measured figures (``MEASURED``: each way's paired
  ratio to ``jax.jit`` and ``jax.jit``'s median time, averaged over the
  runs) and the programs of the jax the runs used (``RUNS_JAX``); what
  public figures or first principles give is pinned (``PINNED``, each with
  its source), and only what the runs identify (``START``) is fitted, by
  least squares on the log error of each way's ratio (and, weighed less,
  of ``jax.jit``'s time). Written to ``jaxstreams/xla/fitted_costs.py``,
  with each way's in-sample error to
  ``benchmarks/results/h100/jax<version>/step_time_fit_h100_jax<version>.txt``
  (how the fit reproduces its own data: no evidence of accuracy).
* held out (always, for every jax's committed programs): each model
  estimated by the constants refitted on the other five, each way by those
  refitted without that way's ratios; the errors, the orders the runs
  separate that the held-out estimate got wrong, and each fitted
  constant's spread across the refits, to
  ``step_time_held_out_h100_jax<version>.{txt,json}``; each jaxstreams
  way's widest held-out error range to ``fitted_costs.HELD_OUT``, which the
  default weighs its estimate by. ``tests/test_step_time.py`` recomputes
  them (seconds: nothing is compiled).

To refit (new runs, a new jax): add the runs' result files to
``MEASURED``, ``python benchmarks/fit_step_time.py --compile`` under each
jax to compile its programs, then ``python benchmarks/fit_step_time.py``.

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
# 0.11.2: the second GPU session's (the earlier run) and the third's, the
# current ones; the first session's timed ways under other names, before
# the ways had their present form, and is left out).
MEASURED = ("h100/jax0.11.2/gpu_levers_earlier_run_gpu_jax0.11.2.json",
            "h100/jax0.11.2/gpu_levers_gpu_jax0.11.2.json",
            "h100/jax0.11.2/gpu_levers_two_candidates_gpu_jax0.11.2.json")
REFERENCE = "jax.jit"
# The jax the runs used: the constants are fitted to its programs.
RUNS_JAX = "0.11.2"
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
US = 1e-6
# What public figures or first principles give is pinned, each with its
# source; the runs (six models, one GPU, ~40 ratios) do not identify these:
# fitted free, they swung by 10-1000x from one held-out fit to the next.
PINNED = {
    # A kernel launched from the host: about 4-6 us through the driver and
    # runtime calls (a measurement with CUDA 13 and driver 580, "pegainfer
    # (3): From Launch Overhead to CUDA Graph", susun-blog.com; DESIGN.md,
    # "Costs and limits": "a kernel launch several us"). XLA's own thunk
    # adds to it; a fit with this free put it at 6-9 us.
    "kernel": (5e-6, "a kernel launch, 4-6 us (CUDA runtime, published)"),
    # A library call launched one by one launches its kernel (XLA keeps the
    # plan and algorithm); only the Inception-style step has such calls, so
    # no second model could check a figure of its own.
    "library": (5e-6, "one kernel launch (first principles; one model has it)"),
    # A CUDA graph is submitted as one unit: for a few kernels its launch
    # costs about one kernel launch (a one-kernel graph's replay measured
    # 9% below a direct launch on a B200: "Four counter-intuitive lessons
    # from deep-diving GPU kernel dispatch overhead", dogacel.github.io,
    # 2026; NVIDIA's "Getting Started with CUDA Graphs" on why); what grows
    # with its size is fitted (graph_node).
    "graph": (5e-6, "one kernel launch (CUDA graphs, published)"),
    # A stream call records and waits for an event at its start and at its
    # done: about 1 us each (DESIGN.md, "Costs and limits").
    "stream_call": (2e-6, "two event records and waits, ~1 us each"),
    # jax's dispatch per argument and per result buffer (PJRT's bookkeeping):
    # in the runs it moves only with the call's fixed cost, which is fitted.
    "argument": (1e-6, "per buffer, order 1 us (first principles)"),
    "result": (1e-6, "per buffer, order 1 us (first principles)"),
    # No run has a loop or a conditional outside the graphs. A loop of known
    # trip count runs its body's launches again each step (its counter's
    # update is a kernel of the body, counted there): nothing more. Waiting
    # for the device's predicate or branch index is a copy launched like a
    # kernel, and the wait itself, which the play counts.
    "loop_step": (0.0, "nothing beyond its body's launches (no run has one)"),
    "host_wait": (5e-6, "a copy launched like a kernel (no run has one)"),
}
# A cuBLAS or cuDNN call in a graph is one node of it (first principles;
# only the Inception-style step has them).
TIED = {"graph_library": "graph_node"}
# Fitted: what the runs identify (each moves ratios of several models), with
# its first guess and bounds.
START = {"call": 30 * US, "graph_node": 0.3 * US, "kernel_time": 1.5 * US,
         "graph_latency": 1 * US, "graph_issue": 0.5 * US,
         "stream_latency": 1 * US, "efficiency": 0.4}
BOUNDS = {k: (1e-8, 1e-3) for k in START}
BOUNDS["efficiency"] = (0.01, 1.0)
# jax.jit's own time weighs less than a ratio (the runs' machines and
# clocks move it more).
REFERENCE_WEIGHT = 0.5


def result_file(kind: str, jax_version: str,
                suffix: str = "txt") -> pathlib.Path:
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
  return {model: {"ratio": {w: statistics.mean(r)
                            for w, r in e["ratios"].items()},
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
    programs[name] = {way: view.program.to_json()
                      for way, view in views.items()}
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
      program = (data if isinstance(data, GpuProgram)
                 else GpuProgram.from_json(data))
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


def separated(figures: dict) -> list[tuple[str, str]]:
  """For one model (its entry of ``measured()``): the pairs of ways (faster,
  slower) that the runs separate by more than their own spread: the
  slowest run of the first beats the fastest of the second by more than
  either's runs spread (jax.jit's ratio is 1.0 by construction: its spread
  is taken as that of ``jaxstreams inline``, the same program). The only
  orders a ranking is checked on."""
  runs = dict(figures["runs"])
  inline = runs.get("jaxstreams inline", [1.0])
  runs[REFERENCE] = [1.0, max(inline) / min(inline)]
  spread = {w: max(r) / min(r) - 1 for w, r in runs.items()}
  return [(a, b) for a in runs for b in runs
          if a != b and min(runs[a]) / max(runs[b]) - 1
          > max(spread[a], spread[b])]


def costs_of(values: dict):
  """``LaunchCosts`` of the fitted ``values``, the pinned and the tied."""
  from jaxstreams.xla.step_time import LaunchCosts
  found = {k: value for k, (value, _) in PINNED.items()}
  found.update(values)
  found.update({k: found[source] for k, source in TIED.items()})
  return LaunchCosts(**found)


def parse(programs: dict) -> dict:
  """Model -> way -> ``GpuProgram`` of plain data (or parsed already)."""
  from jaxstreams.xla.launches import GpuProgram
  return {m: {w: d if isinstance(d, GpuProgram) else GpuProgram.from_json(d)
              for w, d in ways.items()}
          for m, ways in programs.items()}


def fit(programs: dict, figures: dict, device, leave_out_way=None):
  """The ``START`` constants that minimise the squared log errors of each
  way's ratio to jax.jit (and, weighed by ``REFERENCE_WEIGHT``, of jax.jit's
  time) over ``programs`` (model -> way -> program, parsed or plain), less
  ``leave_out_way``'s ratios: least squares in the constants' logarithms,
  within ``BOUNDS``. Returns (``LaunchCosts``, the loss)."""
  import numpy as np
  from scipy.optimize import least_squares
  parsed = parse({m: {w: d for w, d in ways.items() if w != leave_out_way}
                  for m, ways in programs.items()})
  free = list(START)
  low = np.log([BOUNDS[k][0] for k in free])
  high = np.log([BOUNDS[k][1] for k in free])

  def costs(x):
    return costs_of({k: float(math.exp(v)) for k, v in zip(free, x)})

  def residuals(x):
    found = errors(predict(parsed, costs(x), device), figures)
    return np.array([(REFERENCE_WEIGHT if way == REFERENCE else 1.0)
                     * math.log1p(error)
                     for row in found.values() for way, error in row.items()])

  # Tolerances of 1e-3 in the logarithms: a tenth of a percent in each
  # constant, far inside what the held-out fits move them by.
  result = least_squares(residuals, np.log([START[k] for k in free]),
                         bounds=(low, high), diff_step=1e-3, ftol=1e-3,
                         xtol=1e-3)
  return costs(result.x), float(2 * result.cost)


def held_out(programs: dict, figures: dict, device) -> dict:
  """Each model estimated by the constants fitted to the other five
  (``models``: model -> way -> error of its ratio, jax.jit's: of its time),
  each way by those fitted without that way's ratios (``ways``: way ->
  model -> error), the fitted constants of each refit (``constants``:
  name -> the values), and, per model, the orders the runs separate
  (``separated``) that the held-out estimate got wrong (``misordered``)."""
  programs = parse(programs)
  found = {"models": {}, "ways": {}, "constants": {k: [] for k in START},
           "separated": {}, "misordered": {}}
  for model in programs:
    rest = {m: ways for m, ways in programs.items() if m != model}
    costs, _ = fit(rest, figures, device)
    for key in START:
      found["constants"][key].append(getattr(costs, key))
    steps = predict({model: programs[model]}, costs, device)[model]
    found["models"][model] = errors({model: steps}, figures)[model]
    pairs = [(a, b) for a, b in separated(figures[model])
             if a in steps and b in steps]
    found["separated"][model] = len(pairs)
    found["misordered"][model] = [f"{a} > {b}" for a, b in pairs
                                  if steps[a] >= steps[b]]
  ways = sorted({w for m in programs.values() for w in m} - {REFERENCE})
  for way in ways:
    costs, _ = fit(programs, figures, device, leave_out_way=way)
    estimated = errors(predict({m: {w: d for w, d in ws.items()
                                    if w in (way, REFERENCE)}
                                for m, ws in programs.items()}, costs, device),
                       figures)
    found["ways"][way] = {m: row[way] for m, row in estimated.items()
                          if way in row}
  return found


def error_range(found: dict, way: str) -> tuple[float, float]:
  """The lowest and highest held-out error of ``way``'s ratio to jax.jit,
  over the models left out and the refit without that way."""
  values = [row[way] for row in found["models"].values() if way in row]
  values += list(found["ways"].get(way, {}).values())
  return min(values), max(values)


def held_out_report(found: dict, jax_version: str) -> str:
  lines = [f"Step-time estimate held out, against the H100 runs "
           f"({', '.join(MEASURED)}); programs compiled for an H100 without "
           f"one, jax {jax_version}.",
           "Leave one model out: the constants refitted on the other five "
           "models (fit_step_time.fit), this model estimated. Error: each "
           "way's estimated ratio to jax.jit over the measured one (mean of "
           "the runs), less 1; jax.jit's own time the same.", ""]
  for model, row in found["models"].items():
    worst = max((w for w in row if w != REFERENCE), key=lambda w: abs(row[w]))
    lines.append(f"{model}: worst ratio error {row[worst]:+.0%} ({worst}); "
                 f"jax.jit's time {row[REFERENCE]:+.0%}")
    for way, error in row.items():
      if way != REFERENCE:
        lines.append(f"  {way:32s} {error:+6.1%}")
    wrong = found["misordered"][model]
    lines.append(f"  orders the runs separate (by more than their spread): "
                 f"{found['separated'][model]}, held-out estimate wrong on "
                 f"{len(wrong)}" + (f": {'; '.join(wrong)}" if wrong else ""))
  lines += ["", "Leave one way out: the constants refitted without that "
            "way's ratios (all six models), that way estimated:"]
  for way, row in found["ways"].items():
    lines.append(f"  {way:32s} " + "  ".join(f"{m} {e:+.0%}"
                                            for m, e in row.items()))
  lines += ["", "Held-out error range per way (both refits):"]
  for way in found["ways"]:
    low, high = error_range(found, way)
    lines.append(f"  {way:32s} {low:+.0%} .. {high:+.0%}")
  lines += ["", "Fitted constants across the six leave-one-model-out fits "
            "(us; efficiency: share of the peaks): least-most"]
  for key, values in found["constants"].items():
    scale = 1 if key == "efficiency" else 1e6
    lines.append(f"  {key:16s} {min(values) * scale:.3f}-"
                 f"{max(values) * scale:.3f}")
  lines += ["", "Pinned (not fitted):"]
  for key, (value, source) in PINNED.items():
    lines.append(f"  {key:16s} {value * 1e6:.3f}  {source}")
  for key, source in TIED.items():
    lines.append(f"  {key:16s} = {source}  (a library call in a graph is one "
                 "node of it)")
  return "\n".join(lines) + "\n"


def report(costs, predicted, figures, jax_version: str, loss: float) -> str:
  how = (f"fitted to them, loss {loss:.4f} (sum of squared log errors)"
         if loss is not None else "the committed constants (not refitted)")
  lines = [f"Step-time estimate against the H100 runs it was fitted to "
           f"({', '.join(MEASURED)}); programs compiled for an H100 without "
           f"one, jax {jax_version}; {how}. In-sample: how the fit reproduces "
           "its own data, no evidence of accuracy (that is the held-out "
           "file, step_time_held_out_h100_jax<version>.txt).",
           "Per model: each way's ratio to jax.jit, estimated / measured "
           "(mean of the runs, their spread), and the error; jax.jit's "
           "time.", ""]
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
  lines += ["", "constants (us; efficiency: share of the peaks):"]
  for key, value in sorted(vars(costs).items()):
    lines.append(f"  {key:16s} "
                 f"{value if key == 'efficiency' else value * 1e6:.3f}"
                 + ("  (pinned)" if key in PINNED else
                    "  (tied)" if key in TIED else ""))
  return "\n".join(lines) + "\n"


def committed_programs() -> dict:
  """jax version -> the committed programs (model -> way -> plain data)."""
  found = {}
  for path in sorted((RESULTS / "h100").glob(
      "jax*/step_time_programs_h100_*.json")):
    data = json.loads(path.read_text())
    found[data["jax"]] = data["programs"]
  return found


def held_out_ranges(by_jax: dict) -> tuple[dict, tuple[float, float]]:
  """jaxstreams way -> the widest held-out error range of its ratio to
  jax.jit over every jax's programs (``by_jax``: jax -> ``held_out``); and
  the widest of jax.jit's own step, each model left out."""
  found = {}
  steps = []
  for result in by_jax.values():
    steps += [row[REFERENCE] for row in result["models"].values()]
    for way in result["ways"]:
      if not way.startswith("jaxstreams "):
        continue
      name = way.split(" ", 1)[1]
      low, high = error_range(result, way)
      old = found.get(name, (low, high))
      found[name] = (min(low, old[0]), max(high, old[1]))
  return found, (min(steps), max(steps))


def write_constants(costs, jax_version: str, ranges: dict,
                    step_range: tuple[float, float]) -> None:
  values = ",\n".join(f"    {k}={v!r}" for k, v in vars(costs).items())
  runs = "".join(f"\n* ``benchmarks/results/{name}``" for name in MEASURED)
  pinned = "".join(f"\n* ``{k}``: {v * 1e6:g} us, {why}"
                   for k, (v, why) in PINNED.items())
  pinned += "".join(f"\n* ``{k}``: as ``{v}``" for k, v in TIED.items())
  held = "".join(f"\n    {w!r}: ({low!r}, {high!r}),"
                 for w, (low, high) in sorted(ranges.items()))
  FITTED.write_text('''"""The step-time estimate's constants '''
                    f'''(``step_time.LaunchCosts``), fitted
to H100 runs by ``benchmarks/fit_step_time.py`` from programs compiled on
jax {jax_version}. Do not edit by hand: refit (see that script). Runs:
{runs}

Pinned, not fitted (public figures or first principles; the runs do not
identify them):
{pinned}

``HELD_OUT``: per jaxstreams way, the lowest and highest error of its
estimated ratio to ``jax.jit`` (estimated / measured, less 1) where the
constants were fitted without that model or that way, over every jax's
compiled programs (``step_time_held_out_h100_jax<version>.txt``): what the
estimate's figure for that kind of program may be off by, and what the
default weighs it with (``jaxstreams.choose.estimated``). ``STEP_HELD_OUT``:
the same for ``jax.jit``'s own step time, each model left out: what a
step's figure in microseconds may be off by.
"""

from jaxstreams.xla.step_time import LaunchCosts

H100 = LaunchCosts(
{values})

HELD_OUT = {{{held}
}}

STEP_HELD_OUT = {step_range!r}
''')
  print("wrote", FITTED)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--compile", action="store_true",
                      help="compile the models first, on the installed jax "
                      "(needs the CUDA plugin)")
  parser.add_argument("--no-write", action="store_true",
                      help="print the fit, write nothing")
  parser.add_argument("--evaluate", action="store_true",
                      help="no fit: the committed constants' errors on the "
                      "installed jax's programs, saved as "
                      "step_time_estimate_h100_jax<version>.txt")
  args = parser.parse_args(argv)
  sys.path.insert(0, str(ROOT))
  from jaxstreams.xla import target
  from jaxstreams.xla.step_time import Device
  device = Device.of("h100", target.BUILTIN_TARGETS["h100"])
  figures = measured()
  if args.compile or args.evaluate:
    import jax
    path = result_file("programs", jax.__version__, "json")
    if args.compile:
      compile_programs(path)
  if args.evaluate:
    from jaxstreams.xla import fitted_costs
    data = json.loads(path.read_text())
    text = report(fitted_costs.H100,
                  predict(data["programs"], fitted_costs.H100, device),
                  figures, data["jax"], None)
    print(text)
    if not args.no_write:
      result_file("estimate", data["jax"]).write_text(text)
    return 0
  programs = committed_programs()
  costs, loss = fit(programs[RUNS_JAX], figures, device)
  text = report(costs, predict(programs[RUNS_JAX], costs, device), figures,
                RUNS_JAX, loss)
  print(text)
  by_jax = {}
  for version, found in programs.items():
    by_jax[version] = held_out(found, figures, device)
    text = held_out_report(by_jax[version], version)
    print(text)
    if not args.no_write:
      result_file("held_out", version).write_text(text)
      result_file("held_out", version, "json").write_text(
          json.dumps(dict(by_jax[version], jax=version), indent=1) + "\n")
  if not args.no_write:
    result_file("fit", RUNS_JAX).write_text(report(
        costs, predict(programs[RUNS_JAX], costs, device), figures, RUNS_JAX,
        loss))
    write_constants(costs, RUNS_JAX, *held_out_ranges(by_jax))
  return 0


if __name__ == "__main__":
  sys.exit(main())
