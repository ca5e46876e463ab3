"""The jaxstreams benchmark suite: jaxstreams against jax.jit, XLA's own
concurrency and the same placement written by hand with compute_on.

Workloads (benchmarks/workloads/): an Inception-style stack of multi-branch
blocks, a DLRM-style recommender, a bank of small MLPs, a host-to-device
staging loop, and a negative control. Each case compiles every candidate for
the same inputs, warms them up, then times them in alternating order
(``block_until_ready`` on every call) and reports the median and
ratio = baseline time / jaxstreams time (above 1: jaxstreams is faster).

Writes suite_<platform>_jax<version>[_quick].json, .md and .png (the chart needs
matplotlib; without it the chart is skipped with a note).

  python benchmarks/suite.py [--quick] [--out DIR] [--only inception,dlrm]
                             [--reps 21] [--warmup 3] [--streams 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (after the path is set)
from _common import OUT_HELP, load, machine, out_folder  # noqa: E402
from workloads import WORKLOADS, common  # noqa: E402

CPU_NOTE = (
    "On CPU, jaxstreams lowers its regions inline (XLA:CPU has one stream), "
    "so the program it runs is the one jax.jit runs and ratios near 1.0 are "
    "what to expect: differences are noise, not scheduling. The GPU-only "
    "baselines (XLA CONCURRENT, compute_on) are marked n/a. The staging "
    "ratios measure host threads, which do overlap on CPU.")


# ---------------------------------------------------------------------------
# Measuring one case.

def _leaves(out):
  return [np.asarray(x, dtype=np.float64)
          for x in jax.tree_util.tree_leaves(out)]


def _rel_diff(out, ref) -> float:
  a, b = _leaves(out), _leaves(ref)
  if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
    return math.inf
  worst = 0.0
  for x, y in zip(a, b):
    scale = max(1.0, float(np.max(np.abs(y))) if y.size else 1.0)
    if x.size:
      worst = max(worst, float(np.max(np.abs(x - y))) / scale)
  return worst


def _memory(cand) -> dict:
  mem = {"compiled_total_bytes": None, "compiled_temp_bytes": None,
         "device_peak_bytes": None}
  if cand.compiled is not None:
    try:
      ma = cand.compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without it reports null
      ma = None
    if ma is not None:
      mem["compiled_temp_bytes"] = int(ma.temp_size_in_bytes)
      mem["compiled_total_bytes"] = int(
          ma.argument_size_in_bytes + ma.output_size_in_bytes +
          ma.temp_size_in_bytes - ma.alias_size_in_bytes)
  stats = jax.devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    mem["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
  return mem


def measure(case, *, warmup: int, reps: int, target_s: float,
            max_calls: int, tolerance: float) -> dict:
  live = {n: c for n, c in case.candidates.items() if c.run is not None}
  outputs, memory, single = {}, {}, {}
  for name, cand in live.items():
    out = None
    for _ in range(max(1, warmup)):
      start = time.perf_counter()
      out = jax.block_until_ready(cand.run())
      single[name] = time.perf_counter() - start
    outputs[name] = out
    memory[name] = _memory(cand)

  ref_name = case.reference if case.reference in live else next(iter(live))
  reference_time = single.get(ref_name, 0.0)
  calls = 1
  if target_s > 0 and reference_time > 0:
    calls = int(min(max_calls, max(1, math.ceil(target_s / reference_time))))

  names = list(live)
  samples = {n: [] for n in names}
  for r in range(reps):
    for name in (names if r % 2 == 0 else names[::-1]):   # alternate order
      run = live[name].run
      start = time.perf_counter()
      for _ in range(calls):
        jax.block_until_ready(run())
      samples[name].append((time.perf_counter() - start) / calls)

  times = {n: (float(np.median(samples[n])) if n in live else None)
           for n in case.candidates}
  status = {n: c.status for n, c in case.candidates.items()}
  diffs = {n: _rel_diff(outputs[n], outputs[ref_name]) for n in live}
  cand_t = times.get(case.candidate)
  ratios = {b: (times[b] / cand_t if times.get(b) and cand_t else None)
            for b in case.baselines}
  # The same ratio round by round (samples taken next to each other), whose
  # median is less sensitive to load that changes during the run.
  paired = {b: (float(np.median(np.divide(samples[b], samples[case.candidate])))
                if b in live and case.candidate in live else None)
            for b in case.baselines}
  cand_mem = memory.get(case.candidate, {}).get("compiled_total_bytes")
  ref_mem = memory.get(ref_name, {}).get("compiled_total_bytes")
  return {
      "workload": case.workload, "size": case.size,
      "candidate": case.candidate, "baselines": case.baselines,
      "reference": ref_name, "status": status, "times_s": times,
      "samples_s": samples, "calls_per_sample": calls, "ratios": ratios,
      "paired_ratios_median": paired,
      "memory": {n: memory.get(n) for n in case.candidates},
      "memory_ratio_vs_reference": (cand_mem / ref_mem
                                    if cand_mem and ref_mem else None),
      "annotated_calls_cuda_lowering": {
          n: c.annotated_calls for n, c in case.candidates.items()
          if c.annotated_calls is not None},
      "call_starts_compiled": {n: c.call_starts
                               for n, c in case.candidates.items()
                               if c.call_starts is not None},
      "scheduled_overlap": {n: c.scheduled for n, c in case.candidates.items()
                            if c.scheduled is not None},
      "max_rel_diff_vs_reference": diffs,
      "agrees": all(d <= tolerance for d in diffs.values()),
      "notes": case.notes,
      "candidate_chose": case.chose() if case.chose is not None else None,
  }


# ---------------------------------------------------------------------------
# Reports.

def _size_str(size: dict) -> str:
  return " ".join(f"{k}={v}" for k, v in size.items())


def _ms(t):
  return "n/a" if t is None else f"{t * 1e3:.3f}"


def _ratio_cell(r, name):
  t = r["times_s"].get(name)
  if t is None:
    st = r["status"].get(name, "")
    return "n/a" if st.startswith("n/a") else "error"
  ratio = r["ratios"].get(name)
  return f"{ratio:.3f} ({_ms(t)})" if ratio is not None else _ms(t)


def _schedule_cell(scheduled) -> str:
  """Regions with other work in their window, of all async regions, in the
  program XLA:GPU compiled (a real GPU's, or a deviceless H100's)."""
  if scheduled is None:
    return "-"
  if isinstance(scheduled, str):
    return scheduled.replace("|", "/")     # n/a: why
  return (f"{scheduled['overlapped']}/{scheduled['regions']} overlapped, peak "
          f"{scheduled['peak_in_flight']} ({scheduled['target']})")


def markdown(report: dict) -> str:
  m = report["machine"]
  lines = [
      f"# jaxstreams benchmark suite: {m['device_kind']} ({m['platform']})",
      "",
      f"- created: {report['created']}, total run time "
      f"{report['total_seconds']:.0f} s"
      f"{' (quick mode)' if report['quick'] else ''}",
      f"- machine: {m['cpu_model']}, {m['cpu_cores']} cores "
      f"({m['cpu_cores_usable']} usable); {m['os']}; load average (1, 5, "
      f"15 min) {m.get('load_average_at_start')} at start, "
      f"{m.get('load_average_at_end')} at end",
      f"- device: {m['device_kind']} x{m['device_count']} "
      f"(backend {m['backend']}); python {m['python']}, jax {m['jax']}, "
      f"jaxlib {m['jaxlib']}",
      f"- streams given to jaxstreams: {report['streams']}",
      f"- method: {report['method']['description']}",
      "",
  ]
  if m["platform"] == "cpu":
    lines += [f"> {CPU_NOTE}", ""]
  lines += [
      "Cells are ratio = baseline time / candidate time (above 1.0: the "
      "candidate is faster), with the baseline's median ms in brackets. "
      "The candidate is jaxstreams with each off-main region a call on its "
      "stream (`jaxstreams_gpu_lowering=\"streams\"`; jaxstreams' default "
      "way and the others are compared in `gpu_levers.py`); in `staging` it is "
      "`jaxstreams.prefetch` "
      "and the baselines the loop without prefetching and a hand-written "
      "prefetch thread. `mem` is the "
      "candidate's compiled footprint (arguments + outputs + temporaries) "
      "over the reference's. `XLA schedule`: of the candidate's async "
      "regions in the program XLA:GPU compiled, how many have other work "
      "scheduled inside their start..done window, and the most in flight at "
      "once (order, not time; on a machine without a GPU, from a deviceless "
      "H100 compile, which needs the CUDA plugin and JAX_PLATFORMS=cpu).",
      "",
      "| workload | size | candidate ms | vs jax.jit | vs XLA CONCURRENT | "
      "vs compute_on | other baselines | mem | agrees | XLA schedule |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  standard = ("jax.jit", "XLA CONCURRENT", "compute_on")
  for r in report["results"]:
    other = "; ".join(f"{b}: {_ratio_cell(r, b)}" for b in r["baselines"]
                      if b not in standard) or "-"
    cells = [_ratio_cell(r, b) if b in r["baselines"] else "-"
             for b in standard]
    mem = r["memory_ratio_vs_reference"]
    lines.append(
        f"| {r['workload']} | {_size_str(r['size'])} | "
        f"{_ms(r['times_s'].get(r['candidate']))} | {' | '.join(cells)} | "
        f"{other} | {'n/a' if mem is None else f'{mem:.2f}'} | "
        f"{'yes' if r['agrees'] else 'NO'} | "
        f"{_schedule_cell(r.get('scheduled_overlap', {}).get(r['candidate']))}"
        " |")
  chose = [r for r in report["results"] if r.get("candidate_chose")]
  if chose:
    lines += ["", "What the candidate chose while it was timed "
              "(`mode=\"measured\"`, every loop, warm-up included):", ""]
    for r in chose:
      c = r["candidate_chose"]
      lines.append(
          f"- {r['workload']} {_size_str(r['size'])}: {c['loops']} loops, "
          f"ended in {c['ended_in']}, {c['loops_that_switched']} switched, "
          f"{c['trials']} trials, {c['items_inline']} items inline and "
          f"{c['items_by_workers']} by workers; last reason: "
          f"{c['last_reason']}")
  statuses = sorted({f"{n}: {s}" for r in report["results"]
                     for n, s in r["status"].items() if s != "ok"})
  if statuses:
    lines += ["", "Candidates not run here:", ""]
    lines += [f"- {s}" for s in statuses]
  lines += ["", "Workloads:", ""]
  for name, doc in report["workloads"].items():
    lines.append(f"- `{name}`: {doc}")
  lines += ["", f"Raw numbers (every sample, memory, annotated-call counts): "
            f"`{os.path.basename(report['files']['json'])}`.", ""]
  return "\n".join(lines)


def chart(report: dict, path: str) -> bool:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("note: matplotlib is not installed; skipping the chart "
          "(pip install matplotlib)")
    return False
  results = report["results"]
  baselines = []
  for r in results:
    for b, v in r["ratios"].items():
      if v is not None and b not in baselines:
        baselines.append(b)
  labels = [f"{r['workload']}\n" + "\n".join(
      f"{k}={v}" for k, v in list(r["size"].items())[:2]) for r in results]
  fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(results) + 2), 5))
  colors = {b: f"C{i}" for i, b in enumerate(baselines)}
  per_case = max(1, max(sum(v is not None for v in r["ratios"].values())
                        for r in results))
  width = 0.8 / per_case
  labelled = set()
  for j, r in enumerate(results):
    shown = [b for b in baselines if r["ratios"].get(b) is not None]
    for k, b in enumerate(shown):   # centred on the case's tick
      ax.bar(j + (k - (len(shown) - 1) / 2) * width, r["ratios"][b], width,
             color=colors[b], label=None if b in labelled else f"vs {b}")
      labelled.add(b)
  ax.axhline(1.0, color="black", linewidth=0.8)
  ax.set_xticks(range(len(results)))
  ax.set_xticklabels(labels, fontsize=7)
  ax.set_ylabel("baseline time / candidate time")
  m = report["machine"]
  ax.set_title(f"jaxstreams suite on {m['device_kind']} ({m['platform']}), "
               f"jax {m['jax']}" + (" [quick]" if report["quick"] else ""))
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


# ---------------------------------------------------------------------------
# XLA's schedule without a GPU: a deviceless compile in a watched child.

CHILD_MEMORY_FRACTION = 0.6   # of the machine's memory, resident, at most
CHILD_TIMEOUT_S = 900


def _resident_bytes(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def _memory_limit() -> int:
  try:
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
               * CHILD_MEMORY_FRACTION)
  except (ValueError, OSError):
    return 8 << 30


def deviceless_schedules(workload, size: dict, streams: int) -> dict | str:
  """The case's XLA schedules (candidate -> summary or ``n/a: ...``) from a
  deviceless H100 compile in a child process that rebuilds the case; or,
  where the child failed, why (``n/a: ...``). The child is killed past
  ``CHILD_MEMORY_FRACTION`` of the machine's memory or ``CHILD_TIMEOUT_S``:
  XLA's deviceless compile of some programs takes more memory than the
  machine has, which in this process would end the whole run. (The child
  rebuilds the whole case, CPU compiles included: a few seconds per case,
  in a benchmark run on purpose.)"""
  cmd = [sys.executable, os.path.abspath(__file__), "--schedule-child",
         workload.NAME, "--size", json.dumps(size), "--streams", str(streams)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env[common.DEVICELESS_HERE] = "1"
  limit = _memory_limit()
  with tempfile.TemporaryFile("w+") as out, \
       tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    why = None
    while proc.poll() is None:
      if _resident_bytes(proc.pid) > limit:
        why = f"the deviceless compile passed {limit / 2**30:.0f} GB"
      elif time.monotonic() > deadline:
        why = f"the deviceless compile took over {CHILD_TIMEOUT_S} s"
      if why:
        proc.kill()
        proc.wait()
        break
      time.sleep(0.2)
    out.seek(0)
    err.seek(0)
    lines = out.read().strip().splitlines()
    if why is None and proc.returncode == 0 and lines:
      return json.loads(lines[-1])
    if why is None:
      tail = err.read().strip().splitlines()[-1:] or ["no output"]
      why = (f"the deviceless compile failed (exit {proc.returncode}): "
             f"{tail[0][:200]}")
  return f"n/a: {why}"


def _schedule_child(args) -> int:
  """``--schedule-child``: build one case with its schedules read here and
  print them as one JSON line."""
  workload = {w.NAME: w for w in WORKLOADS}[args.schedule_child]
  case = workload.build(json.loads(args.size), args.streams,
                        jax.random.PRNGKey(0))
  try:
    print(json.dumps({n: c.scheduled for n, c in case.candidates.items()
                      if c.scheduled is not None}))
  finally:
    case.close()
  return 0


# ---------------------------------------------------------------------------

def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true",
                 help="every workload once, tiny sizes, one repetition")
  p.add_argument("--out", default=None, help=OUT_HELP)
  p.add_argument("--only", default="",
                 help="comma-separated workload names")
  p.add_argument("--reps", type=int, default=21)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--streams", type=int, default=4,
                 help="stream groups for jaxstreams.jit (items k -> k %% N)")
  p.add_argument("--target-ms", type=float, default=50.0,
                 help="repeat calls within a sample up to about this long")
  p.add_argument("--max-calls", type=int, default=200)
  p.add_argument("--schedule-child", metavar="WORKLOAD",
                 help=argparse.SUPPRESS)   # deviceless_schedules' child
  p.add_argument("--size", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.schedule_child:
    return _schedule_child(args)
  if args.streams < 2:
    p.error("--streams must be at least 2")
  if args.quick:
    args.reps, args.warmup, args.target_ms = 1, 1, 0.0

  selected = [w for w in WORKLOADS
              if not args.only or w.NAME in args.only.split(",")]
  if not selected:
    p.error(f"--only matched no workload; known: "
            f"{', '.join(w.NAME for w in WORKLOADS)}")
  tolerance = 2e-2 if jax.default_backend() == "gpu" else 1e-4
  info = machine()
  print(f"device: {info['device_kind']} ({info['platform']}), jax "
        f"{info['jax']}, {info['cpu_model']} x{info['cpu_cores']}")

  started = time.perf_counter()
  key = jax.random.PRNGKey(0)
  results = []
  for workload in selected:
    for size in workload.sizes(args.quick):
      t0 = time.perf_counter()
      case = workload.build(size, args.streams, key)
      if not common.schedules_here() and any(
          c.annotated_calls is not None for c in case.candidates.values()):
        found = deviceless_schedules(workload, size, args.streams)
        if isinstance(found, str):
          found = {case.candidate: found}
        for name, scheduled in found.items():
          if name in case.candidates:
            case.candidates[name].scheduled = scheduled
      try:
        r = measure(case, warmup=args.warmup, reps=args.reps,
                    target_s=args.target_ms / 1e3, max_calls=args.max_calls,
                    tolerance=tolerance)
      finally:
        case.close()
      r["case_seconds"] = time.perf_counter() - t0
      results.append(r)
      ratios = ", ".join(f"{b} {v:.3f}" for b, v in r["ratios"].items()
                         if v is not None)
      print(f"{r['workload']:10s} {_size_str(r['size'])}: "
            f"{r['candidate']} {_ms(r['times_s'][r['candidate']])} ms; "
            f"ratios {ratios or 'none'}; agrees {r['agrees']} "
            f"[{r['case_seconds']:.1f} s]", flush=True)

  # One file set per platform and jax version: what XLA schedules differs
  # between jax versions, so the versions' runs sit side by side.
  stem = (f"suite_{info['platform']}_jax{info['jax']}"
          + ("_quick" if args.quick else ""))
  out = out_folder(args.out)
  files = {ext: os.path.join(out, f"{stem}.{ext}")
           for ext in ("json", "md", "png")}
  report = {
      "suite": "jaxstreams benchmark suite", "quick": args.quick,
      "created": datetime.datetime.now(datetime.timezone.utc)
                 .isoformat(timespec="seconds"),
      "machine": info, "streams": args.streams,
      "method": {
          "warmup_calls": args.warmup, "repetitions": args.reps,
          "target_sample_ms": args.target_ms, "max_calls_per_sample":
          args.max_calls, "statistic": "median",
          "description": (
              f"each candidate compiled ahead of time, warmed up "
              f"({args.warmup} calls), then {args.reps} samples each, "
              "candidates alternating order every round; a sample times "
              "calls_per_sample calls (chosen so a sample lasts about "
              f"{args.target_ms:g} ms), each ended by block_until_ready; "
              "the median sample is reported")},
      "workloads": {w.NAME: " ".join(w.__doc__.split()) for w in selected},
      "results": results, "files": files,
  }
  report["total_seconds"] = time.perf_counter() - started
  info["load_average_at_end"] = load()
  with open(files["json"], "w") as f:
    json.dump(report, f, indent=1, default=str)
  with open(files["md"], "w") as f:
    f.write(markdown(report))
  if not chart(report, files["png"]):
    files["png"] = None
  print(f"wrote {files['json']}, {files['md']}"
        + (f", {files['png']}" if files["png"] else ""))
  print(f"total {report['total_seconds']:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
