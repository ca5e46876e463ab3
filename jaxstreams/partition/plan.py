"""``StreamPlan``: what jaxstreams decided for one traced function, for people.

A frozen report (equations, regions, dependencies, notes, ``str(plan)``,
``to_dot()``, ``to_perfetto()``) built by ``report`` from the
``PartitionedProgram`` that lowering emits. It names values (``a0``, ``c0``,
``v0``) instead of holding jaxpr variables, so nothing in it can change what
is emitted.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import json
import os

import jax.extend.core as jcore

from jaxstreams import _compat
from jaxstreams.assign import equation_name
from jaxstreams.partition.loops import Phase
from jaxstreams.partition.partitioned import (LoopBody, LoopPlan,
                                              PartitionedProgram)
from jaxstreams.partition.regions import transitive_reduction
from jaxstreams.partition.schedule import Schedule
from jaxstreams.tag.read import primitives


@dataclasses.dataclass(frozen=True)
class PlannedEquation:
  """One top-level equation of the traced function and where it runs."""
  index: int
  primitive: str
  name: str        # name stack and primitive, e.g. "jaxstreams_stream_1/sin"
  stream: int
  rule: str        # which rule placed it: user, colocate, body, inside, file,
                   # forward, spread, main, effects, collective
  region: int
  location: str    # file:line (function) of the user code that made it
  note: str = ""
  flops: float = 0.0         # cost-model estimates
  bytes: float = 0.0
  seconds: float = 0.0
  inputs: tuple[str, ...] = ()    # values it reads (literals left out) and
  outputs: tuple[str, ...] = ()   # makes, named as in the regions


@dataclasses.dataclass(frozen=True)
class Region:
  """Equations of one stream emitted together: one call off the main stream,
  inline on it. ``inputs`` and ``outputs`` are value names as in the plan."""
  index: int
  stream: int
  equations: tuple[int, ...]
  inputs: tuple[str, ...]
  outputs: tuple[str, ...]
  # Every primitive the region binds, inside loop bodies, branches and
  # nested jits too: what decides how XLA:GPU can run it (a loop runs
  # outside XLA's CUDA graphs, for one).
  holds: frozenset[str] = frozenset()

  @property
  def is_call(self) -> bool:
    return self.stream != 0


@dataclasses.dataclass(frozen=True)
class LoopGroup:
  """Regions, one scan each (the same direction, each on its own stream,
  none depending on another), that can run as one loop whose steps run
  every body on its region's stream. ``lengths``: each scan's layers;
  ``phases``: the loops they run as (``partition.loops.layout``, positions
  in ``regions``), the first with every scan in it; ``steps`` is its.
  ``bodies``: how each body runs in the one loop on the installed jaxlib,
  decided before emission (``PartitionedProgram.decisions``), one line per
  region in ``regions`` order."""
  regions: tuple[int, ...]
  steps: int
  reverse: bool
  lengths: tuple[int, ...] = ()
  phases: tuple[Phase, ...] = ()
  bodies: tuple[str, ...] = ()

  def describe(self, streams: Sequence[int]) -> str:
    """One line: the regions, their layers, how the loop runs them."""
    name = lambda i: f"R{self.regions[i]}"
    line = "+".join(name(i) for i in range(len(self.regions)))
    if len(set(self.lengths)) > 1:
      line += " (" + ", ".join(f"{name(i)} {n} layers"
                               for i, n in enumerate(self.lengths)) + ")"
    first, *rest = self.phases or (Phase(self.steps, (), (), ()),)
    line += f": {first.steps} steps" + (" (reversed)" if self.reverse else "")
    several = [f"{name(m)} {k} layers" for m, k
               in zip(first.members, first.per_step) if k > 1]
    if several:
      line += " taking " + ", ".join(several) + " a step"
    line += ", bodies on streams " + ", ".join(str(s) for s in streams)
    for phase in rest:
      who = "+".join(name(m) for m in phase.members)
      ranges = ", ".join(f"{name(m)} layers {a}-{b - 1}" for m, (a, b) in zip(
          phase.members, map(phase.layers, range(len(phase.members)))))
      line += ("; " + ("before that" if self.reverse else "then") + f" {ranges}"
               + (" alone, in place" if len(phase.members) == 1
                  else f" as one loop of {phase.steps} steps ({who})"))
    return line


@dataclasses.dataclass(frozen=True)
class Dependency:
  """Region ``consumer`` reads ``values`` made by region ``producer`` on
  another stream; XLA orders the two with an event."""
  producer: int
  consumer: int
  producer_stream: int
  consumer_stream: int
  values: tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class StreamPlan:
  """The stream plan of one traced function (one set of argument shapes).
  Made by ``jaxstreams.plan(f)(*args)`` and ``f.plan(*args)``; read-only."""
  function_name: str
  streams: int
  equations: tuple[PlannedEquation, ...]
  regions: tuple[Region, ...]
  dependencies: tuple[Dependency, ...]   # cross-stream, as XLA will order them
  edges: tuple[tuple[int, int], ...]     # every (producer, consumer) pair of
                                         # regions linked by a value
  schedule: Schedule
  summary: str = ""       # what spreading decided, if on
  gpu_lowering: str = "inline"    # the way a top-level call runs on a GPU
  gpu_reason: str = ""            # what that way is and why, nested calls too
  # The plans of shard_map bodies with regions of their own, by the index of
  # their shard_map equation (rule "inside"); each device runs its body.
  bodies: dict[int, "StreamPlan"] = dataclasses.field(default_factory=dict)
  # Groups of regions, each one loop, that can run as one loop with each
  # body on its stream (the "loops" and "streams" ways do).
  loops: tuple[LoopGroup, ...] = ()
  # Groups of independent loops left apart, each scan its own loop, and why.
  loops_apart: dict[tuple[int, ...], str] = dataclasses.field(
      default_factory=dict)
  # Off-main regions that the installed XLA cannot compile as stream calls,
  # and why: ways with stream calls run them in place (decided before
  # emission, ``PartitionedProgram.decisions``).
  in_place: dict[int, str] = dataclasses.field(default_factory=dict)
  # Loop bodies whose readings of their carry after writing its next value
  # run after their stream call, on the main stream, and why (decided so).
  in_part: dict[int, str] = dataclasses.field(default_factory=dict)
  # What each way needs on the device against jax.jit's program (a
  # ``jaxstreams.lower.memory.WaysMemory``): set by ``f.plan(*args,
  # target=...)``, which compiles every way for that GPU, and on a GPU by
  # the candidates the first calls compiled and timed. None: not compiled.
  memory: Any = None

  @property
  def notes(self) -> tuple[str, ...]:
    """What could not be honoured as asked, one line per equation."""
    return tuple(f"#{e.index} {e.primitive} at {e.location}: {e.note}"
                 for e in self.equations if e.note)

  @property
  def critical_path(self) -> tuple[int, ...]:
    """Regions on the estimated critical path, first to last."""
    return self.schedule.critical_path

  @property
  def estimated_seconds(self) -> float:
    return self.schedule.makespan

  @property
  def streams_used(self) -> tuple[int, ...]:
    return tuple(sorted({r.stream for r in self.regions}))

  @property
  def is_single_stream(self) -> bool:
    """True when everything runs on the main stream (no calls are emitted),
    shard_map bodies included."""
    return (all(not r.is_call for r in self.regions)
            and all(b.is_single_stream for b in self.bodies.values()))

  @property
  def _fuses_loops(self) -> bool:
    return self.gpu_lowering.startswith(("loops", "streams"))

  def _lowered_as(self, region: Region) -> str:
    """How a GPU runs ``region`` under this plan's way."""
    if self._fuses_loops:
      for group in self.loops:
        if region.index in group.regions:
          others = "+".join(f"R{r}" for r in group.regions if r != region.index)
          where = (f"on stream {region.stream}"
                   if region.is_call and region.index not in self.in_place
                   else "in place (main)")
          if region.index in self.in_part:
            where += " (part after the call, main)"
          return f"loop body {where}, one loop with {others}"
    if not region.is_call:
      return "inline (main)"
    if self.gpu_lowering.startswith("streams"):
      if region.index in self.in_place:
        return "inline (see below)"
      return f"call on stream {region.stream}"
    return "inline"

  def region_of(self, equation: int) -> Region:
    return self.regions[self.equations[equation].region]

  def __repr__(self) -> str:
    return (f"<StreamPlan {self.function_name}: {len(self.equations)} "
            f"equations, {len(self.regions)} regions on streams "
            f"{list(self.streams_used)}, {len(self.dependencies)} cross-stream "
            "dependencies>")

  def __str__(self) -> str:
    dependencies = _count(len(self.dependencies), "cross-stream dependency",
                          "cross-stream dependencies")
    lines = [
        f"StreamPlan for {self.function_name}: streams={self.streams}, "
        f"{_count(len(self.equations), 'equation')}, "
        f"{_count(len(self.regions), 'region')}, {dependencies}",
    ]
    if self.summary:
      lines.append(f"  {self.summary}")
    if self.is_single_stream:
      lines.append("  everything runs on the main stream (stream 0): the "
                   "program is lowered exactly as jax.jit lowers it")
    elif self.gpu_reason:
      lines.append(f"  on a GPU: {self.gpu_lowering!r}, {self.gpu_reason}")
      if self.memory is not None:
        lines += [""] + ["  " + line for line in self.memory.lines()]
      else:
        lines.append("  device memory of each way: not compiled yet "
                     "(f.plan(*args, target='h100') compiles every way for "
                     "a GPU and states it)")
    lines.append("")
    lines += _table(
        ["stream", "regions", "equations", "est. GFLOP", "est. MB", "est. us"],
        [[str(s), str(sum(r.stream == s for r in self.regions)),
          str(sum(e.stream == s for e in self.equations)),
          f"{sum(e.flops for e in self.equations if e.stream == s) / 1e9:.3f}",
          f"{sum(e.bytes for e in self.equations if e.stream == s) / 1e6:.3f}",
          "{:.1f}".format(sum(e.seconds for e in self.equations
                              if e.stream == s) * 1e6)]
         for s in self.streams_used])
    lines.append(
        f"  planner's makespan: {self.schedule.makespan * 1e6:.1f} us "
        f"(one stream: {self.schedule.single_stream * 1e6:.1f} us; its cost "
        f"model for placing regions, not the GPU step estimate); critical "
        f"path: {' -> '.join(f'R{r}' for r in self.critical_path) or '-'}")
    lines.append("")
    lines += _table(
        ["region", "stream", "lowered as", "equations", "inputs", "outputs"],
        [[f"R{r.index}", str(r.stream), self._lowered_as(r),
          str(len(r.equations)), _names(r.inputs), _names(r.outputs)]
         for r in self.regions])
    if self.loops:
      together = self._fuses_loops
      lines += ["", "independent loops" + (
          " run as one loop, each body on its region's stream:" if together
          else " that 'loops' and 'streams' run as one loop:")]
      for group in self.loops:
        lines.append("  " + group.describe(
            [self.regions[r].stream for r in group.regions]))
        lines += [f"    {body}" for body in group.bodies]
    if self.loops_apart:
      lines += ["", "independent loops left apart (each its own loop, as "
                "jax.jit runs them):"]
      lines += [f"  {'+'.join(f'R{r}' for r in group)}: {why}"
                for group, why in self.loops_apart.items()]
    grouped = {r for group in self.loops for r in group.regions}
    shown = {r: why for r, why in self.in_place.items()
             if (self._fuses_loops if r in grouped
                 else self.gpu_lowering.startswith("streams"))}
    if shown:
      lines += ["", "regions run in place instead of as stream calls:"]
      lines += [f"  R{r}{' (loop body)' if r in grouped else ''}: {why}"
                for r, why in sorted(shown.items())]
    if self.in_part and self._fuses_loops:
      lines += ["", "loop bodies run in part after their stream call, on the "
                "main stream (what reads the carry after the next one is "
                "written, and what depends on it):"]
      lines += [f"  R{r}: {why}" for r, why in sorted(self.in_part.items())]
    if self.dependencies:
      lines += ["", "cross-stream dependencies:"]
      for d in self.dependencies:
        lines.append(f"  R{d.producer} (stream {d.producer_stream}) -> "
                     f"R{d.consumer} (stream {d.consumer_stream}): "
                     f"{_names(d.values)}")
    lines += ["", "equations (rule: which rule placed each one):"]
    lines += _table(
        ["#", "stream", "region", "rule", "equation", "source"],
        [[str(e.index), str(e.stream), f"R{e.region}", e.rule, e.name,
          e.location] for e in self.equations])
    if self.notes:
      lines += ["", "notes:"] + [f"  - {n}" for n in self.notes]
    for index, body in self.bodies.items():
      lines += ["", f"the body of #{index} "
                f"({self.equations[index].primitive}), on every device:"]
      body = dataclasses.replace(body, gpu_lowering=self.gpu_lowering,
                                 gpu_reason="")   # it runs as its caller does
      lines += ["  " + line if line else line
                for line in str(body).splitlines()]
    return "\n".join(lines)

  def to_perfetto(self, path: str | os.PathLike | None = None) -> dict:
    """The estimated schedule as Chrome-trace JSON (opens in ui.perfetto.dev
    or chrome://tracing): one track per stream, one span per region. Writes
    it to ``path`` if given; returns the JSON object."""
    trace = _chrome_trace(self)
    if path is not None:
      with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f, indent=1)
    return trace

  def to_dot(self) -> str:
    """Graphviz source: one node per region, clustered by stream, and the
    dependencies between regions (cross-stream ones in bold red)."""
    out = [f'digraph "{_dot_escape(self.function_name)}" {{',
           "  rankdir=TB;", '  node [shape=box, fontname="monospace"];']
    for stream in self.streams_used:
      out.append(f"  subgraph cluster_stream{stream} {{")
      out.append(f'    label="stream {stream}";')
      for r in self.regions:
        if r.stream == stream:
          prims = _summarize([self.equations[i].primitive for i in r.equations])
          out.append(f'    R{r.index} [label="R{r.index}\\n'
                     f'{_dot_escape(prims)}"];')
      out.append("  }")
    cross = {(d.producer, d.consumer) for d in self.dependencies}
    for a, b in self.edges:
      style = ' [color=red, penwidth=2]' if (a, b) in cross else ""
      if (self.regions[a].stream != self.regions[b].stream
          and (a, b) not in cross):
        style = ' [color=gray, style=dashed]'
      out.append(f"  R{a} -> R{b}{style};")
    out.append("}")
    return "\n".join(out)


def _chrome_trace(plan: "StreamPlan") -> dict:
  events = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0,
             "args": {"name": f"{plan.function_name} (estimated)"}}]
  for stream in plan.streams_used:
    events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": stream,
                   "args": {"name": f"stream {stream}"}})
  for region in plan.regions:
    start = plan.schedule.start[region.index]
    end = plan.schedule.end[region.index]
    events.append({
        "ph": "X", "cat": "jaxstreams.plan", "name": f"R{region.index}",
        "pid": 0, "tid": region.stream, "ts": start * 1e6,
        "dur": (end - start) * 1e6,
        "args": {"equations": len(region.equations),
                 "critical": region.index in plan.critical_path}})
  return {"traceEvents": events, "displayTimeUnit": "ms",
          "otherData": {"generator": "jaxstreams.StreamPlan.to_perfetto",
                        "estimated_step_us": plan.schedule.makespan * 1e6}}


def _count(n: int, singular: str, plural: str | None = None) -> str:
  return f"{n} {singular if n == 1 else plural or singular + 's'}"


def _names(names: Sequence[str], limit: int = 6) -> str:
  if not names:
    return "-"
  shown = ", ".join(names[:limit])
  return shown + (f", +{len(names) - limit}" if len(names) > limit else "")


def _summarize(primitives: Sequence[str], limit: int = 4) -> str:
  counts: dict[str, int] = {}
  for p in primitives:
    counts[p] = counts.get(p, 0) + 1
  parts = [f"{p} x{n}" if n > 1 else p for p, n in counts.items()]
  return ", ".join(parts[:limit]) + (" ..." if len(parts) > limit else "")


def _dot_escape(text: str) -> str:
  return text.replace("\\", "\\\\").replace('"', '\\"')


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
            for i, h in enumerate(header)]
  fmt = lambda cells: "  " + "  ".join(
      c.ljust(w) for c, w in zip(cells, widths)).rstrip()
  return [fmt(header)] + [fmt(r) for r in rows]


def report(partitioned: PartitionedProgram) -> StreamPlan:
  """The user's report of a partitioned program. Names and source lines are
  the slow part of a plan: this runs only when someone asks for the plan."""
  jaxpr = partitioned.program.jaxpr
  graph = partitioned.graph
  names = _value_names(jaxpr)
  named = lambda values: tuple(names[v] for v in values
                               if not isinstance(v, jcore.Literal))
  equations = tuple(
      PlannedEquation(
          index, eqn.primitive.name, equation_name(eqn), placement.stream,
          placement.rule, graph.region_of[index], _compat.source_location(eqn),
          placement.note, cost.flops, cost.bytes, cost.seconds(),
          named(eqn.invars), named(eqn.outvars))
      for index, (eqn, placement, cost) in enumerate(
          zip(jaxpr.eqns, partitioned.placements, partitioned.costs)))
  regions = tuple(
      Region(i, graph.streams[i], tuple(graph.members[i]),
             named(graph.inputs[i]), named(graph.outputs[i]),
             primitives(partitioned.region_equations(i)))
      for i in range(len(graph.streams)))
  decisions = partitioned.decisions
  grouped = {r for group in decisions.loops for r in group.regions}
  whole, part = decisions.bodies_in_place()
  kept = (transitive_reduction(len(regions), graph.edges)
          if partitioned.reduce_stream_wait else set(graph.edges))
  dependencies = tuple(
      Dependency(a, b, graph.streams[a], graph.streams[b], named(values))
      for (a, b), values in sorted(graph.edges.items())
      if (a, b) in kept and graph.streams[a] != graph.streams[b])
  return StreamPlan(
      function_name=partitioned.function_name, streams=partitioned.streams,
      equations=equations, regions=regions, dependencies=dependencies,
      edges=tuple(sorted(graph.edges)), schedule=partitioned.schedule,
      summary=partitioned.summary,
      bodies={i: report(body) for i, body in partitioned.bodies.items()},
      loops=tuple(_loop_group(partitioned, g)
                  for g in partitioned.decisions.loops),
      loops_apart=dict(graph.loops_apart),
      in_place={**{r: why for r, why in decisions.in_place.items()
                   if r not in grouped}, **whole},
      in_part=part)


def _loop_group(partitioned: PartitionedProgram, group: LoopPlan
                ) -> LoopGroup:
  """The report of a loop group as decided before emission."""
  return LoopGroup(group.regions, group.phases[0].steps, group.reverse,
                   group.lengths, group.phases,
                   tuple(_body_line(partitioned, b) for b in group.bodies))


def _body_line(partitioned: PartitionedProgram, body: LoopBody) -> str:
  """How one body of a loop group runs in the one loop, in a line."""
  stream = partitioned.graph.streams[body.region]
  line = f"R{body.region} body: "
  if stream == 0:
    return line + "in place, on the main stream"
  if body.in_place is not None:
    return line + ("in place, on the main stream (XLA cannot compile it as "
                   "a stream call; see below)")
  line += f"a stream call on stream {stream} each step"
  if not body.tail:
    return line
  after = ", ".join(f"#{k} {body.eqns[k].primitive.name}" for k in body.tail)
  return (line + f", then its equations {after} (of {len(body.eqns)}) on "
          "the main stream")


def _value_names(jaxpr) -> dict[Any, str]:
  """Stable, readable names: arguments a0.., constants c0.., values v0..."""
  names: dict[Any, str] = {}
  for i, v in enumerate(jaxpr.invars):
    names[v] = f"a{i}"
  for i, v in enumerate(jaxpr.constvars):
    names[v] = f"c{i}"
  count = 0
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      names[v] = f"v{count}"
      count += 1
  return names
