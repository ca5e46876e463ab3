"""What the GPU launches for a compiled program, seen without a GPU.

XLA:GPU runs most of a step as CUDA graphs ("command buffers"), and the
graph's edges, not the order of the HLO schedule, decide which kernels may
run at the same time; what it cannot put into a graph (loops, convolutions
unless enabled, work of a stream call it leaves out) it launches kernel by
kernel, in order, from one host thread. How XLA draws a graph's edges
depends on the jaxlib and on ``xla_gpu_command_buffer_scheduling_mode``: in
jaxlib 0.10 and 0.11 the default builder chains every command after the
previous one; jaxlib 0.12 forks at a stream call and joins at its first
reader; ``CONCURRENT`` draws edges from data.

``xla_graphs`` compiles a lowered program for a GPU in a child process with
XLA's command-buffer log on (XLA reads its logging settings once per
process; ``_graph_child.py``), reads the log and XLA's dumps
(``xla_logs``), builds the model of what the GPU launches
(``launches.GpuProgram``) and returns the view, ``XlaGraphs``: the graphs,
and per stream, in order, every graph, loose kernel, library call, copy,
loop (its trip count, whether the host waits every step), conditional and
stream call, with the plan regions in flight together.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Any

from jaxstreams import _compat
from jaxstreams.lower.memory import Footprint
from jaxstreams.xla import kept_compiles
from jaxstreams.xla._graph_child import MARKER, ChildFailed, CompileChild
from jaxstreams.xla.launches import (Conditional, CudaGraph, GpuProgram,
                                     GraphLaunch, Kernel, KernelLaunch, Loop,
                                     StreamCall, read_program)
from jaxstreams.xla.step_time import Device, StepEstimate, estimate_step
from jaxstreams.xla.xla_logs import GraphLogError, command_types

__all__ = ["CudaGraph", "GraphLogError", "Kernel", "OutsideGraph", "XlaGraphs",
           "read_graphs", "xla_graphs", "xla_graphs_of"]

# What the child turns on: the graph builder's commands and edges, and the
# conversion pass's account of what it put into graphs.
LOG_MODULES = "command_executor=3,command_buffer_conversion_pass=2"


@dataclasses.dataclass(frozen=True)
class OutsideGraph:
  """An annotated call XLA left out of every CUDA graph: its start waits on
  an event of the launching stream, its kernels are launched one by one on
  its stream, and its done makes the launching stream wait."""
  instruction: str            # the call-start
  region: int | None          # the plan region, where known
  stream: int                 # XLA's stream
  kernels: tuple[str, ...]    # what it launches
  reason: str


class XlaGraphs:
  """What the GPU launches for one compiled program (``program``, a
  ``launches.GpuProgram``), and its CUDA graphs. Made by ``xla_graphs``;
  ``read_graphs`` makes one from XLA's text."""

  def __init__(self, program: GpuProgram, plan=None,
               command_types: tuple[str, ...] | None = None,
               target: tuple[str, str] | None = None,
               memory: Footprint | None = None):
    self.program = program
    self.plan = plan
    # The target compiled for: its name and description (None: unknown).
    self.target = target
    # XLA's memory analysis of the compiled program (None: not given).
    self.memory = memory
    # The command types XLA put into graphs for this program (its log).
    self.command_types = command_types
    self.graphs = program.graphs
    launches = tuple(program.walk())
    self.outside = tuple(_outside(call, window)
                         for call, window in _calls_in_sequence(
                             program.launches))
    self.loops = tuple(l for l in launches if isinstance(l, Loop))
    self.conditionals = tuple(c for c in launches if isinstance(c, Conditional))
    # Launches made one by one, outside any graph.
    self.ungraphed = tuple(k.instruction or k.name
                           for k in program.loose_kernels)

  @property
  def kernels(self) -> int:
    return sum(len(g.kernels) for g in self.graphs)

  @property
  def parallelism(self) -> float:
    """The largest graph's parallelism (1.0 where the step has no graph:
    ``summary`` says so)."""
    if not self.graphs:
      return 1.0
    return max(self.graphs, key=lambda g: len(g.kernels)).parallelism

  def parallel_regions(self) -> tuple[tuple[int, int], ...]:
    """Pairs of plan regions whose work may be in flight at the same time:
    parallel branches of one graph, or one in a stream call's window while
    the other's work is launched on another stream (loop bodies included:
    there, in every step)."""
    return self.program.parallel_regions()

  def compare(self, plan=None) -> tuple[tuple[int, int, bool], ...]:
    """For each pair of off-main regions the plan lets run together (on
    different streams, neither depending on the other), whether they may
    run at the same time in what XLA launches: ``(first, second, bool)``."""
    from jaxstreams.xla.schedule import _reachability as plan_reach
    plan = plan if plan is not None else self.plan
    if plan is None:
      raise ValueError("XlaGraphs.compare needs the StreamPlan of the program")
    reach = plan_reach(plan)
    parallel = set(self.parallel_regions())
    calls = [r for r in plan.regions if r.is_call]
    checks = []
    for i, a in enumerate(calls):
      for b in calls[i + 1:]:
        if (a.stream == b.stream or b.index in reach[a.index]
            or a.index in reach[b.index]):
          continue
        checks.append((a.index, b.index, (a.index, b.index) in parallel))
    return tuple(checks)

  @functools.cached_property
  def estimate(self) -> StepEstimate:
    """The step's estimated time on the target (``step_time``): the device's
    critical path, the host's launch time, which bounds the step."""
    from jaxstreams.xla import fitted_costs
    from jaxstreams.xla import target as targets
    name, config = self.target or ("h100", targets.BUILTIN_TARGETS["h100"])
    if not config:   # this machine's own GPU: its description is not read
      name, config = "an H100 (the local GPU's peaks are not read)", \
          targets.BUILTIN_TARGETS["h100"]
    return estimate_step(self.program, fitted_costs.H100,
                         Device.of(name, config))

  def summary(self) -> str:
    loose = self.program.loose_kernels
    if self.graphs:
      head = (f"{len(self.graphs)} CUDA graph(s), {self.kernels} kernel(s) in "
              f"them")
    else:
      head = "no CUDA graph: every launch is made one by one"
    parts = [f"{len(self.loops)} loop(s)" if self.loops else "",
             f"{len(self.conditionals)} conditional(s)" if self.conditionals
             else "",
             f"{len(self.outside)} stream call(s)",
             f"{len(loose)} launch(es) outside any graph"]
    lines = [head + "; " + ", ".join(p for p in parts if p),
             str(self.estimate)]
    if self.memory is not None:
      lines.append(f"device memory (XLA's analysis): {self.memory.describe()}")
    for g in self.graphs:
      lines.append(
          f"graph {g.index} ({g.name}, {g.mode}): {len(g.kernels)} kernels, "
          f"longest path {g.longest_path}, parallelism {g.parallelism:.2f}"
          + (", one chain" if g.sequential else "")
          + (f", regions {_regions_text(g.regions)}" if g.regions else ""))
    for loop in self.loops:
      lines.append(f"loop {loop.instruction or '?'}: {_steps(loop)}; each "
                   f"step: {_brief(loop.body)}")
    pairs = self.parallel_regions()
    if pairs:
      lines.append("regions side by side: " + ", ".join(
          f"R{a}|R{b}" for a, b in pairs))
    counted: dict[tuple, int] = {}
    for o in self.outside:
      key = (_label(o.region, o.instruction), o.stream, o.reason)
      counted[key] = counted.get(key, 0) + 1
    for (label, stream, reason), count in counted.items():
      times = f" ({count} calls)" if count > 1 else ""
      lines.append(f"outside any graph: {label} on stream {stream}{times}: "
                   f"{reason}")
    return "\n".join(lines)

  def launch_order(self) -> str:
    """Everything the host launches, in order, nested launches indented:
    ``[k]`` is the XLA stream a launch goes to (0 the main stream)."""
    lines: list[str] = []
    _order_lines(self.program.launches, 1, lines)
    return "\n".join(lines)

  def __str__(self) -> str:
    lines = [self.summary(), "", "launch order ([k]: XLA stream):",
             self.launch_order()]
    for g in self.graphs:
      lines += ["", f"graph {g.index}: node  region  stream  waits for  kernel"]
      for k in g.kernels:
        lines.append(f"  {k.node:>4}  {_label(k.region, '-'):>6}  "
                     f"{k.stream:>6}  "
                     f"{','.join(map(str, k.inputs)) or '-':>9}  {k.name}"
                     + (f" ({k.instruction})" if k.instruction else ""))
    return "\n".join(lines)

  def to_dot(self) -> str:
    """Graphviz source: one cluster per graph, kernels coloured by plan
    region, the graph's edges."""
    palette = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
               "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]
    out = ["digraph xla_graphs {", "  rankdir=TB;",
           '  node [shape=box, style=filled, fontname="monospace"];']
    for g in self.graphs:
      out.append(f"  subgraph cluster_g{g.index} {{")
      out.append(f'    label="graph {g.index}: parallelism '
                 f'{g.parallelism:.2f}";')
      for k in g.kernels:
        colour = ("#dddddd" if k.region is None
                  else palette[k.region % len(palette)])
        out.append(f'    g{g.index}n{k.node} [label="{_label(k.region, "main")}'
                   f'\\n{k.name}", fillcolor="{colour}"];')
      for a, b in g.edges:
        out.append(f"    g{g.index}n{a} -> g{g.index}n{b};")
      out.append("  }")
    for o in self.outside:
      out.append(f'  "{o.instruction}" '
                 f'[label="{_label(o.region, o.instruction)} '
                 f'outside graphs\\nstream {o.stream}", shape=octagon];')
    out.append("}")
    return "\n".join(out)

  def to_perfetto(self, path=None) -> dict:
    """A Chrome/Perfetto trace of each graph laid out by dependency depth:
    one lane per plan region, one unit of "time" per step along the longest
    path (order, not time). Side-by-side branches overlap."""
    events, lanes = [], {}
    for g in self.graphs:
      depth = g.depths()
      for k in g.kernels:
        lane = lanes.setdefault((g.index, k.region), len(lanes))
        events.append({"name": k.name, "ph": "X", "ts": depth[k.node] - 1,
                       "dur": 1, "pid": g.index, "tid": lane,
                       "args": {"instruction": k.instruction, "node": k.node,
                                "waits_for": list(k.inputs)}})
    for (graph, region), lane in lanes.items():
      events.append({"name": "thread_name", "ph": "M", "pid": graph,
                     "tid": lane, "args": {"name": _label(region, "main")}})
    trace = {"traceEvents": events, "displayTimeUnit": "ns"}
    if path is not None:
      with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    return trace


def read_graphs(log: str, sequence: str | None, metadata: str | None,
                hlo: str, buffers: str | None = None, plan=None,
                target: tuple[str, str] | None = None,
                memory: dict | None = None) -> XlaGraphs:
  """What the GPU launches for a compiled program, from XLA's command-buffer
  log, its thunk-sequence dump, its compiled HLO text and, for graphs whose
  node list the log cut short, its buffer-assignment dump (``xla_graphs``
  gathers all of them in a child process); ``target``: the name and
  description (``target_config``) of the GPU it was compiled for, whose
  peaks the step-time estimate uses (None: an H100); ``memory``: XLA's
  memory analysis, by its field names."""
  return XlaGraphs(read_program(log, sequence, metadata, hlo, buffers), plan,
                   command_types(log), target, _footprint(memory))


def _footprint(memory: dict | None) -> Footprint | None:
  if not memory:
    return None
  return Footprint(
      memory["temp_size_in_bytes"], memory["argument_size_in_bytes"],
      memory["output_size_in_bytes"], memory["alias_size_in_bytes"],
      memory.get("generated_code_size_in_bytes", 0))


def _calls_in_sequence(launches):
  """Each planned stream call with the launches made while it is in flight
  (its window, in the sequence that holds it), nested ones after."""
  for at, launch in enumerate(launches):
    if isinstance(launch, StreamCall):
      if launch.planned:
        yield launch, launches[at + 1:at + 1 + launch.window]
      yield from _calls_in_sequence(launch.launches)
    elif isinstance(launch, Loop):
      yield from _calls_in_sequence(launch.condition)
      yield from _calls_in_sequence(launch.body)
    elif isinstance(launch, Conditional):
      for branch in launch.branches:
        yield from _calls_in_sequence(branch)
    elif isinstance(launch, GraphLaunch):
      yield from _calls_in_sequence(launch.nested)


def _outside(call: StreamCall, window=()) -> OutsideGraph:
  """Why XLA left ``call`` out of every graph: what it holds or what its
  ``window`` holds that XLA does not put in a graph (a call, and every call
  in flight with it, go into one graph or none), or else a span of fewer
  top-level commands than XLA's minimum graph size."""
  launches = list(_flatten(call.launches))
  kinds = sorted({l.thunk for l in launches if isinstance(l, KernelLaunch)}
                 - {"kCustomKernel", "kKernel"})
  kinds += sorted({type(l).__name__.lower() for l in launches
                   if isinstance(l, (Loop, Conditional))})
  own = [l.instruction for l in window
         if isinstance(l, StreamCall) and not l.planned]
  beside = ([f"XLA's own asynchronous work ({', '.join(own)})"]
            if own else [])
  beside += [f"{type(l).__name__.lower()} {l.instruction}" for l in window
             if isinstance(l, (Loop, Conditional))]
  beside += [l.instruction or l.name for l in window
             if isinstance(l, KernelLaunch)
             and l.thunk not in ("kCustomKernel", "kKernel")]
  if kinds:
    reason = f"it holds {', '.join(kinds)}, which XLA does not put in a graph"
  elif beside:
    reason = (f"it is in flight over {', '.join(beside)}, which XLA does not "
              "put in a graph")
  else:
    reason = ("XLA did not convert it (its span has fewer top-level commands "
              "than xla_gpu_graph_min_graph_size, 5 by default, a stream call "
              "counting two; or it is in flight with a call left out)")
  names = tuple(l.name if isinstance(l, KernelLaunch) else
                f"graph {l.graph.index}" if isinstance(l, GraphLaunch) else
                type(l).__name__.lower() for l in call.launches)
  return OutsideGraph(call.instruction, call.region, call.stream, names, reason)


def _flatten(launches):
  for launch in launches:
    yield launch
    if isinstance(launch, StreamCall):
      yield from _flatten(launch.launches)
    elif isinstance(launch, Loop):
      yield from _flatten(launch.body)


def _steps(loop: Loop) -> str:
  if loop.trip_count is not None:
    return (f"{loop.trip_count} steps, a known count (the host launches them "
            "without waiting)")
  if loop.host_waits:
    return ("trip count unknown: the host copies the predicate back and waits "
            "for it every step")
  return "trip count unknown, decided on the GPU"


def _brief(launches) -> str:
  """A one-line account of a sequence of launches (a region's stream calls
  counted: XLA from jaxlib 0.11 would make one of each result of a call
  with several, which jaxstreams' calls avoid by returning one tuple)."""
  parts: dict[str, int] = {}
  loose = [l for l in launches if isinstance(l, KernelLaunch)]
  for l in launches:
    if isinstance(l, GraphLaunch):
      text = f"graph {l.graph.index}"
    elif isinstance(l, StreamCall) and l.planned:
      text = f"{_label(l.region, l.instruction)} on stream {l.stream}"
    elif isinstance(l, Loop):
      text = f"loop {l.instruction}"
    elif isinstance(l, Conditional):
      text = f"conditional {l.instruction}"
    else:
      continue
    parts[text] = parts.get(text, 0) + 1
  texts = [text if count == 1 else f"{text} ({count} calls)"
           for text, count in parts.items()]
  if loose:
    texts.append(f"{len(loose)} launch(es) one by one")
  return ", ".join(texts) or "nothing"


def _order_lines(launches, depth: int, lines: list[str]) -> None:
  pad = "  " * depth
  run: list[KernelLaunch] = []

  def flush():
    if not run:
      return
    streams = sorted({k.stream for k in run})
    names = ", ".join(_kernel_text(k) for k in run[:6])
    more = f", +{len(run) - 6}" if len(run) > 6 else ""
    lines.append(f"{pad}[{','.join(map(str, streams))}] {len(run)} one by one: "
                 f"{names}{more}")
    run.clear()

  for launch in launches:
    if isinstance(launch, KernelLaunch):
      if run and run[-1].stream != launch.stream:
        flush()
      run.append(launch)
      continue
    flush()
    if isinstance(launch, GraphLaunch):
      g = launch.graph
      lines.append(f"{pad}[{launch.stream}] graph {g.index} ({g.mode}): "
                   f"{len(g.kernels)} kernels, parallelism {g.parallelism:.2f}"
                   + (f", regions {_regions_text(g.regions)}" if g.regions
                      else ""))
      _order_lines(launch.nested, depth + 1, lines)
    elif isinstance(launch, StreamCall):
      what = (f"stream call {_label(launch.region, launch.instruction)}"
              if launch.planned else f"XLA's own {launch.instruction}")
      lines.append(f"{pad}[{launch.stream}] {what} (in flight over the next "
                   f"{launch.window} launch(es)):")
      _order_lines(launch.launches, depth + 1, lines)
    elif isinstance(launch, Loop):
      lines.append(f"{pad}[{launch.stream}] loop {launch.instruction}: "
                   f"{_steps(launch)}; each step:")
      _order_lines(launch.body, depth + 1, lines)
    elif isinstance(launch, Conditional):
      waits = ("the host waits for the branch index" if launch.host_waits
               else "the branch chosen on the GPU")
      lines.append(f"{pad}[{launch.stream}] conditional {launch.instruction} "
                   f"({waits}), {len(launch.branches)} branches:")
      for k, branch in enumerate(launch.branches):
        lines.append(f"{pad}  branch {k}:")
        _order_lines(branch, depth + 2, lines)
  flush()


def _kernel_text(k: KernelLaunch) -> str:
  text = k.name if k.kind == "kernel" else f"{k.kind} {k.instruction or k.name}"
  return text + (f" (R{k.region})" if k.region is not None else "")


def _label(region, fallback) -> str:
  return f"R{region}" if region is not None else str(fallback)


def _regions_text(regions) -> str:
  return " ".join(f"R{r}" for r in regions)


# ---------------------------------------------------------------------------
# Compiling in a child process.

def xla_graphs(lowered: Any, *, target: Any = "h100",
               compiler_options: dict | None = None, plan=None,
               timeout: float = 600) -> XlaGraphs:
  """What XLA:GPU launches for ``lowered`` (its CUDA graphs, and everything
  else in order), compiled in a child process: no GPU needed, and none of
  this process's devices used. The CUDA plugin must be installed at
  jaxlib's version (as for ``gpu_target``).

  ``lowered`` is a program lowered for CUDA: ``f.trace(*args).lower(
  lowering_platforms=("cuda",))`` on any machine, or ``f.lower(*args)`` of
  arguments on a GPU or on ``gpu_target(...).abstract``. It is compiled with
  the compiler options its own ``compile()`` would use, plus
  ``compiler_options``. ``target``: "h100" (default), "h200", the path of a
  GpuTargetConfigProto text file, a ``GpuTarget``, or "local": this
  machine's own GPU (XLA autotunes there, as the program's own compile
  does). With the function's ``plan``, ``compare()`` checks the plan's
  pairs of regions. A program partitioned over several devices is compiled
  for a node of that many GPUs; the graphs are one device's. The view's
  ``estimate`` is the step's estimated time on the target, its ``memory``
  XLA's memory analysis of the compiled program.
  """
  texts = capture(lowered, target=target, compiler_options=compiler_options,
                  timeout=timeout)
  return read_graphs(**texts, plan=plan, target=target_text(target))


def xla_graphs_of(lowered: dict[str, Any], *, target: Any = "h100",
                  plans: dict | None = None, timeout: float = 600
                  ) -> dict[str, "XlaGraphs | GraphLogError"]:
  """``xla_graphs`` of several programs (name -> lowered), compiled one
  after the other in one child process (one start of jax and of the CUDA
  compiler for all, and the kernels they share compiled once: the ways of
  one function). A program that did not compile, or whose launches cannot
  be read, gets the ``GraphLogError`` saying why, in its place."""
  captured = capture_all(lowered, target=target, timeout=timeout)
  views: dict[str, XlaGraphs | GraphLogError] = {}
  for name, texts in captured.items():
    if isinstance(texts, GraphLogError):
      views[name] = texts
      continue
    try:
      views[name] = read_graphs(**texts, plan=(plans or {}).get(name),
                                target=target_text(target))
    except Exception as error:  # noqa: BLE001 - one program's view
      views[name] = GraphLogError(f"{name}: its launches could not be read "
                                  f"({type(error).__name__}: {error})")
  return views


def target_text(target: Any) -> tuple[str, str]:
  """A target's name and description, as ``XlaGraphs`` keeps it ("" for
  this machine's own GPU)."""
  from jaxstreams.xla import target as targets
  if isinstance(target, targets.GpuTarget):
    return target.name, target.config_text
  if isinstance(target, str) and target == "local":
    return "local", ""
  return targets.target_config(target)


def capture(lowered: Any, *, target: Any = "h100",
            compiler_options: dict | None = None,
            timeout: float = 600) -> dict[str, Any]:
  """XLA's own text for ``lowered`` compiled for ``target`` (see
  ``xla_graphs``): its command-buffer log (``log``), thunk dump
  (``sequence``, ``metadata``), compiled HLO (``hlo``), buffer
  assignment (``buffers``) and memory analysis (``memory``), which
  ``read_graphs`` reads. Kept as JSON, they are fixtures: a GPU's own
  compile, checked later against a deviceless one."""
  (texts,) = capture_all({"": lowered}, target=target,
                         compiler_options=compiler_options,
                         timeout=timeout).values()
  if isinstance(texts, GraphLogError):
    raise texts
  return texts


def capture_all(lowered: dict[str, Any], *, target: Any = "h100",
                compiler_options: dict | None = None, timeout: float = 600
                ) -> dict[str, "dict[str, Any] | GraphLogError"]:
  """``capture`` of several programs (name -> lowered) in one child
  process; a program that did not compile gets a ``GraphLogError``."""
  local = isinstance(target, str) and target == "local"
  name, config_text = target_text(target)
  programs, devices = [], 1
  for one in lowered.values():
    options = {**_compat.lowered_compiler_options(one),
               **(compiler_options or {})}
    text = one.as_text(debug_info=True)
    partitions = re.search(r"mhlo\.num_partitions = (\d+)", text)
    devices = max(devices, int(partitions.group(1)) if partitions else 1)
    programs.append({"module": text, "compiler_options": {
        k: _option_text(v) for k, v in options.items()}})
  names = [None if local else kept_compiles.key(
      program, name, config_text, devices, LOG_MODULES) for program in programs]
  kept = [None if n is None else kept_compiles.load(n) for n in names]
  todo = [k for k, found in enumerate(kept) if found is None]
  if todo:
    fresh = _compile_in_child([programs[k] for k in todo], name, config_text,
                              devices, local, timeout)
    for k, found in zip(todo, fresh):
      kept[k] = found
      if names[k] is not None and "error" not in found:
        kept_compiles.store(names[k], found)
  captured: dict[str, dict[str, Any] | GraphLogError] = {}
  for key, found in zip(lowered, kept):
    if "error" in found:
      captured[key] = GraphLogError(f"{key or 'the program'} did not compile "
                                    f"for {name}: {found['error']}")
      continue
    captured[key] = {"log": found["log"], "sequence": found["sequence"],
                     "metadata": found["metadata"], "hlo": found["hlo"],
                     "buffers": found.get("buffers"),
                     "memory": found.get("memory")}
  return captured


def _compile_in_child(programs: list[dict], name: str, config_text: str,
                      devices: int, local: bool, timeout: float) -> list[dict]:
  """The child's answer for each program, its part of XLA's log added
  (``log``); ``error`` where it did not compile."""
  request = {"programs": programs, "target_name": name,
             "target_config": config_text, "devices": devices}
  package_root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=LOG_MODULES,
             PYTHONPATH=os.pathsep.join(
                 [package_root]
                 + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  if not local:
    env["JAX_PLATFORMS"] = "cpu"
  try:
    answer, log = CompileChild.request(request, env, timeout)
  except ChildFailed as error:
    raise GraphLogError(f"compiling for {name} in a child process failed "
                        f"({error})") from None
  out = answer["programs"]   # the child answers only lines that hold them
  return [dict(found, log=log) for found, log in
          zip(out, _split_log(log, len(out)))]


def _split_log(stderr: str, count: int) -> list[str]:
  """The child's stderr cut at its markers: program ``k``'s log."""
  parts = re.split(rf"^{re.escape(MARKER)}(\d+)$", stderr, flags=re.MULTILINE)
  logs = [""] * count
  for index, text in zip(parts[1::2], parts[2::2]):
    logs[int(index)] = text
  return logs


def _option_text(value) -> Any:
  """A compiler option as the child passes it on (JSON has no enums)."""
  return value if isinstance(value, (bool, int, float, str)) else str(value)
