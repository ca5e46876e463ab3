"""What the GPU launches: the CUDA graphs XLA:GPU builds from a compiled program.

XLA:GPU runs most of a step as CUDA graphs ("command buffers"): after
scheduling it gathers runs of convertible thunks into graphs, and the graph's
edges, not the order of the HLO schedule, decide which kernels may run at
the same time. How it draws them depends on the jaxlib and on
``xla_gpu_command_buffer_scheduling_mode``: in jaxlib 0.10 and 0.11 the
default builder chains every command after the previous one, so regions on
different streams become one sequence; jaxlib 0.12 forks at a region's start
and joins at its first reader; ``CONCURRENT`` draws edges from data.

Nothing public reports the graph. XLA logs it while compiling, when asked
with ``TF_CPP_VMODULE=command_executor=3`` (one line per command, then each
node's in-edges), and it reads that setting once per process, so
``xla_graphs`` compiles in a child process started with it
(``_graph_child.py``) and reads the log there, together with XLA's
thunk-sequence dump (which command is which HLO instruction) and the
compiled HLO (which instruction belongs to which plan region). A log it
does not understand is a ``GraphLogError``, never a guess.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from typing import Any, Sequence

from jaxstreams import _compat
from jaxstreams._compat import REGION_ATTRIBUTE
from jaxstreams.lower.emit import REGION_SCOPE
from jaxstreams.xla.schedule import HloParseError, _computations

# What the child turns on: the graph builder's commands and edges, and the
# conversion pass's account of what it put into graphs.
LOG_MODULES = "command_executor=3,command_buffer_conversion_pass=2"
# Kernels of regions emitted in place are found by emit's name scope.
_REGION_SCOPE_RE = re.compile(
    re.escape(REGION_SCOPE).replace(re.escape("{index}"), r"(\d+)"))

_MODE = re.compile(r"CreateCommandOperations with synchronization mode: (\w+)")
_COMMAND = re.compile(r"command_executor\.cc:\d+\] (.*?)(?:\s+resources=\[(.*?)(\])?)?\s*$")
_GRAPH = re.compile(r"Execution graph: ExecutionGraph: (\d+) nodes, .*?"
                    r"is_sequential=(true|false)")
_NODE = re.compile(r"^node (\d+) \(priority=-?\d+\): in=\[(.*?)\] out=\[(.*?)\]\s*$")
_EDGE_ID = re.compile(r"id: (\d+)")
_CREATED = re.compile(r"Creating command buffer thunk(?: (\S+))? with the "
                      r"following thunks: (.*)$")
_DUMP_LINE = re.compile(r"^( *)(\d+): (k\w+)\s*\[[^\]]*\]\s?(.*)$")
_STREAM_OF_START = re.compile(r"stream=\w+\[(\d+)\]")


class GraphLogError(RuntimeError):
  """XLA's command-buffer log (or thunk dump) is not in a form this version
  of jaxstreams understands; the message says what was expected."""


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One command of a CUDA graph: a kernel launch (or a copy, a library
  call) and the commands it waits for."""
  node: int                   # its node id in the graph
  name: str                   # the kernel's name as XLA logs it
  instruction: str | None     # the HLO instruction it runs
  region: int | None          # the plan region it belongs to, where known
  stream: int                 # XLA's stream: 0 main, k an annotated call's
  inputs: tuple[int, ...]     # nodes it waits for (the graph's in-edges)


@dataclasses.dataclass(frozen=True)
class CudaGraph:
  """One command buffer XLA launches as a CUDA graph."""
  index: int
  name: str                   # XLA's name for the command-buffer thunk
  mode: str                   # how XLA drew the edges: LHS or Concurrent
  kernels: tuple[Kernel, ...]
  sequential: bool            # XLA's own verdict: one chain

  @property
  def edges(self) -> tuple[tuple[int, int], ...]:
    return tuple((i, k.node) for k in self.kernels for i in k.inputs)

  def depths(self) -> dict[int, int]:
    """Per node, the kernels on the longest path that ends at it."""
    depth: dict[int, int] = {}
    for kernel in _in_order(self.kernels):
      depth[kernel.node] = 1 + max((depth[i] for i in kernel.inputs), default=0)
    return depth

  @property
  def longest_path(self) -> int:
    """Kernels on the longest dependency path."""
    return max(self.depths().values(), default=0)

  @property
  def parallelism(self) -> float:
    """Kernels over the longest path: 1 for a chain, the number of equal
    branches for side-by-side ones."""
    longest = self.longest_path
    return len(self.kernels) / longest if longest else 0.0

  @property
  def regions(self) -> tuple[int, ...]:
    return tuple(sorted({k.region for k in self.kernels if k.region is not None}))

  def parallel_regions(self) -> tuple[tuple[int, int], ...]:
    """Pairs of plan regions in this graph that can run side by side: some
    kernel of one and some kernel of the other have no path between them."""
    upstream = _reachability(self.kernels)
    downstream: dict[int, int] = {k.node: 0 for k in self.kernels}
    for kernel in self.kernels:
      mask = upstream[kernel.node]
      while mask:
        low = mask & -mask
        downstream[low.bit_length() - 1] |= 1 << kernel.node
        mask ^= low
    nodes: dict[int, int] = {}     # region -> bitmask of its kernels
    for kernel in self.kernels:
      if kernel.region is not None:
        nodes[kernel.region] = nodes.get(kernel.region, 0) | (1 << kernel.node)
    found = []
    regions = sorted(nodes)
    for i, a in enumerate(regions):
      for b in regions[i + 1:]:
        if any(nodes[b] & ~(upstream[k.node] | downstream[k.node])
               for k in self.kernels if k.region == a):
          found.append((a, b))
    return tuple(found)


@dataclasses.dataclass(frozen=True)
class OutsideGraph:
  """An annotated call XLA left out of every CUDA graph: its start waits on
  an event of the main stream, its kernels are launched one by one on its
  stream, and its done makes the main stream wait."""
  instruction: str            # the call-start
  region: int | None          # the plan region, where known
  stream: int                 # XLA's stream
  kernels: tuple[str, ...]    # what it launches
  reason: str


class XlaGraphs:
  """The CUDA graphs of one compiled program, and the regions run outside
  them. Made by ``xla_graphs``; ``read_graphs`` makes one from XLA's text."""

  def __init__(self, graphs: Sequence[CudaGraph],
               outside: Sequence[OutsideGraph], ungraphed: Sequence[str],
               plan=None):
    self.graphs = tuple(graphs)
    self.outside = tuple(outside)
    self.ungraphed = tuple(ungraphed)   # top-level kernels in no graph
    self.plan = plan

  @property
  def kernels(self) -> int:
    return sum(len(g.kernels) for g in self.graphs)

  @property
  def parallelism(self) -> float:
    """The largest graph's parallelism (1.0 where the step has no graph)."""
    if not self.graphs:
      return 1.0
    return max(self.graphs, key=lambda g: len(g.kernels)).parallelism

  def parallel_regions(self) -> tuple[tuple[int, int], ...]:
    """Pairs of plan regions that may run at the same time in what XLA
    launches: parallel branches of one graph, or two regions outside the
    graphs on different streams, or one outside and one in a graph."""
    pairs = {p for g in self.graphs for p in g.parallel_regions()}
    out = [o for o in self.outside if o.region is not None]
    for i, a in enumerate(out):
      for b in out[i + 1:]:
        if a.stream != b.stream:
          pairs.add(tuple(sorted((a.region, b.region))))
    graphed = {r for g in self.graphs for r in g.regions}
    for o in out:
      pairs.update(tuple(sorted((o.region, r))) for r in graphed if r != o.region)
    return tuple(sorted(pairs))

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

  def summary(self) -> str:
    lines = [f"{len(self.graphs)} CUDA graph(s), {self.kernels} kernel(s) in "
             f"them; {len(self.outside)} annotated call(s) and "
             f"{len(self.ungraphed)} kernel(s) outside any graph"]
    for g in self.graphs:
      lines.append(
          f"graph {g.index} ({g.name}, {g.mode}): {len(g.kernels)} kernels, "
          f"longest path {g.longest_path}, parallelism {g.parallelism:.2f}"
          + (", one chain" if g.sequential else "")
          + (f", regions {_regions_text(g.regions)}" if g.regions else ""))
    pairs = self.parallel_regions()
    if pairs:
      lines.append("regions side by side: " + ", ".join(
          f"R{a}|R{b}" for a, b in pairs))
    for o in self.outside:
      lines.append(f"outside any graph: {_label(o.region, o.instruction)} on "
                   f"stream {o.stream} ({len(o.kernels)} kernels): {o.reason}")
    return "\n".join(lines)

  def __str__(self) -> str:
    lines = [self.summary()]
    for g in self.graphs:
      lines += ["", f"graph {g.index}: node  region  stream  waits for  kernel"]
      for k in g.kernels:
        lines.append(f"  {k.node:>4}  {_label(k.region, '-'):>6}  {k.stream:>6}  "
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
      out.append(f'    label="graph {g.index}: parallelism {g.parallelism:.2f}";')
      for k in g.kernels:
        colour = ("#dddddd" if k.region is None
                  else palette[k.region % len(palette)])
        out.append(f'    g{g.index}n{k.node} [label="{_label(k.region, "main")}\\n'
                   f'{k.name}", fillcolor="{colour}"];')
      for a, b in g.edges:
        out.append(f"    g{g.index}n{a} -> g{g.index}n{b};")
      out.append("  }")
    for o in self.outside:
      out.append(f'  "{o.instruction}" [label="{_label(o.region, o.instruction)} '
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


def _label(region, fallback) -> str:
  return f"R{region}" if region is not None else str(fallback)


def _regions_text(regions) -> str:
  return " ".join(f"R{r}" for r in regions)


def _in_order(kernels: Sequence[Kernel]) -> list[Kernel]:
  """Kernels with every kernel after those it waits for (XLA numbers nodes
  in command order, which already is one; checked, not assumed)."""
  by_node = {k.node: k for k in kernels}
  done: set[int] = set()
  order: list[Kernel] = []
  for kernel in sorted(kernels, key=lambda k: k.node):
    stack = [(kernel, False)]
    while stack:
      k, expanded = stack.pop()
      if k.node in done:
        continue
      if expanded:
        done.add(k.node)
        order.append(k)
        continue
      stack.append((k, True))
      for i in k.inputs:
        if i not in done:
          if i not in by_node:
            raise GraphLogError(f"node {k.node} waits for node {i}, which the "
                                "graph does not have")
          stack.append((by_node[i], False))
  return order


def _reachability(kernels: Sequence[Kernel]) -> dict[int, int]:
  """Per node, the bitmask of the nodes upstream of it."""
  reach: dict[int, int] = {}
  for kernel in _in_order(kernels):
    mask = 0
    for i in kernel.inputs:
      mask |= reach[i] | (1 << i)
    reach[kernel.node] = mask
  return reach


# ---------------------------------------------------------------------------
# Reading XLA's text.

@dataclasses.dataclass
class _LoggedGraph:
  mode: str
  commands: list[tuple[str, tuple[tuple[str, str], ...]]]  # text, resources
  nodes: dict[int, tuple[int, ...]] | None = None   # in-edges as logged
  cut_commands: set[int] = dataclasses.field(default_factory=set)
  count: int = 0
  sequential: bool = False
  name: str = ""
  thunks: tuple[str, ...] = ()

  @property
  def truncated(self) -> bool:
    """Whether the log cut the node list short: XLA logs the whole graph as
    one message, and its logger keeps the first 15,000 bytes of a message."""
    return len(self.nodes) < self.count


def parse_log(text: str) -> list[_LoggedGraph]:
  """The graphs XLA's command-buffer log describes, in the order built."""
  graphs: list[_LoggedGraph] = []
  current: _LoggedGraph | None = None
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    line = lines[i]
    i += 1
    mode = _MODE.search(line)
    if mode:
      current = _LoggedGraph(mode.group(1), [])
      graphs.append(current)
      continue
    graph = _GRAPH.search(line)
    if graph:
      if current is None or current.nodes is not None:
        raise GraphLogError("an 'Execution graph' line before the graph's "
                            "'CreateCommandOperations' line")
      current.count = int(graph.group(1))
      nodes: dict[int, tuple[int, ...]] = {}
      while i < len(lines) and lines[i].startswith("node "):
        node = _NODE.match(lines[i])
        i += 1
        if node is None:   # the message was cut off here
          break
        nodes[int(node.group(1))] = tuple(
            int(x) for x in _EDGE_ID.findall(node.group(2)))
      if list(nodes) != list(range(len(nodes))) or \
          len(current.commands) != current.count:
        raise GraphLogError(
            f"a graph of {current.count} nodes logged {len(current.commands)} "
            f"commands and node lines {sorted(nodes)[:5]}...")
      current.nodes = nodes
      current.sequential = graph.group(2) == "true"
      continue
    created = _CREATED.search(line)
    if created:
      # The thunk that owns the graph(s) built since the last one.
      for owned in reversed(graphs):
        if owned.thunks:
          break
        owned.name = created.group(1) or "command_buffer"
        owned.thunks = tuple(t.strip() for t in created.group(2).split(","))
      continue
    command = _COMMAND.search(line)
    if command and current is not None and current.nodes is None:
      resources = tuple(re.findall(r"(\w+@\w+)\((read|write)\)",
                                   command.group(2) or ""))
      if command.group(2) is not None and command.group(3) is None:
        current.cut_commands.add(len(current.commands))
      current.commands.append((command.group(1).strip(), resources))
  unfinished = [g for g in graphs if g.nodes is None]
  if unfinished:
    raise GraphLogError(f"{len(unfinished)} graph(s) logged commands but no "
                        "'Execution graph' (was command_executor=3 in "
                        "TF_CPP_VMODULE?)")
  return graphs


@dataclasses.dataclass
class _Thunk:
  id: int
  kind: str
  text: str
  annotation: str | None = None
  children: list["_Thunk"] = dataclasses.field(default_factory=list)

  def leaves(self):
    """Its commands in graph order: kernels and other leaf thunks, the
    bodies of async starts inlined, their start/done markers left out."""
    if not self.children:
      if self.kind not in ("kAsyncStart", "kAsyncDone", "kSequential"):
        yield self, None
      return
    for child in self.children:
      for leaf, start in child.leaves():
        yield leaf, start if start is not None else (
            self if self.kind == "kAsyncStart" else None)


def parse_thunk_dump(sequence: str, metadata: str | None) -> list[_Thunk]:
  """XLA's ``*.thunk_sequence_after_thunk_passes.txt``: its top-level thunks
  (nested thunks as children), each named by its HLO instruction from
  ``*.thunk_metadata.txt``."""
  names: dict[int, str] = {}
  if metadata:
    for block in re.findall(r"thunk_info \{(.*?)\}", metadata, re.S):
      annotation = re.search(r'profile_annotation: "([^"]*)"', block)
      ident = re.search(r"thunk_id: (\d+)", block)
      if annotation and ident:
        names[int(ident.group(1))] = annotation.group(1)
  roots: list[_Thunk] = []
  stack: list[tuple[int, _Thunk]] = []
  for line in sequence.splitlines():
    if not line.strip() or line.strip() == "No thunks.":   # an empty body
      continue
    match = _DUMP_LINE.match(line)
    if match is None:
      raise GraphLogError(f"a thunk dump line not understood: {line[:160]!r}")
    indent, ident, kind, text = match.groups()
    thunk = _Thunk(int(ident), kind, text.strip(), names.get(int(ident)))
    while stack and stack[-1][0] >= len(indent):
      stack.pop()
    (stack[-1][1].children if stack else roots).append(thunk)
    stack.append((len(indent), thunk))
  return roots


def _command_name(text: str) -> str:
  return text.split(" ", 1)[0]


def read_graphs(log: str, sequence: str | None, metadata: str | None,
                hlo: str, buffers: str | None = None, plan=None) -> XlaGraphs:
  """The CUDA graphs of a compiled program from XLA's command-buffer log,
  its thunk-sequence dump, its compiled HLO text and, for graphs whose
  node list the log cut short, its buffer-assignment dump (``xla_graphs``
  gathers all of them in a child process)."""
  logged = parse_log(log)
  try:
    _, computations = _computations(hlo)
  except HloParseError as error:
    raise GraphLogError(f"the compiled HLO could not be read: {error}") from None
  by_name = {ins.name: ins for body in computations.values() for ins in body}

  def region_of(instruction: str | None) -> int | None:
    ins = by_name.get(instruction or "")
    if ins is None:
      return None
    value = ins.frontend_attribute(REGION_ATTRIBUTE)
    if value is not None:
      return int(value) if value.isdigit() else None
    match = _REGION_SCOPE_RE.search(ins.attributes)
    return int(match.group(1)) if match else None

  roots = parse_thunk_dump(sequence, metadata) if sequence else []
  buffers_of = _BufferUses(buffers, computations) if buffers else None
  command_buffers = [t for t in roots if t.kind == "kCommandBuffer"]
  unused = list(range(len(command_buffers)))
  graphs = []
  for index, entry in enumerate(logged):
    leaves = None
    names = [_command_name(text) for text, _ in entry.commands]
    for b in unused:
      candidate = list(command_buffers[b].leaves())
      if [_command_name(leaf.text) for leaf, _ in candidate] == names:
        leaves = candidate
        unused.remove(b)
        break
    if leaves is None and roots and entry.thunks:
      raise GraphLogError(
          f"no command buffer in XLA's thunk dump holds the {entry.count} "
          f"commands of graph {index} ({', '.join(names[:4])}, ...): the "
          "kernels could not be matched to HLO instructions")
    placed = []
    for node, (text, _) in enumerate(entry.commands):
      instruction, region, stream = None, None, 0
      if leaves is not None:
        leaf, start = leaves[node]
        instruction = leaf.annotation
        if start is not None:
          stream = _stream_of(start)
          region = region_of(start.annotation)
        if region is None:
          region = region_of(instruction)
      placed.append((_command_name(text), instruction, region, stream))
    inputs = _edges(entry, [p[1] for p in placed], buffers_of)
    kernels = tuple(Kernel(node, name, instruction, region, stream, inputs[node])
                    for node, (name, instruction, region, stream)
                    in enumerate(placed))
    graphs.append(CudaGraph(index, entry.name, entry.mode, kernels,
                            entry.sequential))
  outside, ungraphed = [], []
  for thunk in roots:
    if thunk.kind == "kAsyncStart":
      commands = [leaf for leaf, _ in thunk.leaves()]
      kinds = sorted({leaf.kind for leaf in commands} - {"kCustomKernel", "kKernel"})
      reason = (f"it holds {', '.join(kinds)}, which XLA does not put in a "
                "graph" if kinds else
                "XLA did not convert it (fewer commands than "
                "xla_gpu_graph_min_graph_size, or interleaved with such a call)")
      outside.append(OutsideGraph(
          thunk.annotation or f"thunk {thunk.id}", region_of(thunk.annotation),
          _stream_of(thunk), tuple(_command_name(leaf.text) for leaf in commands),
          reason))
    elif thunk.kind not in ("kCommandBuffer", "kAsyncDone", "kSequential"):
      ungraphed.append(thunk.annotation or _command_name(thunk.text))
  return XlaGraphs(graphs, outside, ungraphed, plan)


def _stream_of(start: _Thunk) -> int:
  match = _STREAM_OF_START.search(start.text)
  return int(match.group(1)) if match else 0


def _edges(entry: _LoggedGraph, instructions: Sequence[str | None],
           buffers_of: "_BufferUses | None") -> list[tuple[int, ...]]:
  """Each node's in-edges: as logged where the log has the whole graph.
  Where it was cut short, rebuilt the way XLA builds them (a node waits for
  every earlier node whose buffers or resources conflict with its own, then
  transitive reduction) and checked against every node the log kept."""
  if not entry.truncated:
    return [entry.nodes[n] for n in range(entry.count)]
  if buffers_of is None or any(i is None for i in instructions):
    raise GraphLogError(
        f"XLA's log cut the node list of a {entry.count}-node graph short, and "
        "the buffer-assignment dump needed to rebuild it is missing")
  if entry.cut_commands:
    raise GraphLogError(
        f"XLA's log cut the node list of a {entry.count}-node graph short, and "
        f"the resources of command {min(entry.cut_commands)} too: the graph "
        "cannot be rebuilt")
  uses = [buffers_of.of(i) for i in instructions]
  resources = [r for _, r in entry.commands]
  upstream: list[int] = []
  direct: list[list[int]] = []
  by_allocation: dict[int, list[tuple[int, int, int, bool]]] = {}
  by_resource: dict[str, list[tuple[int, bool]]] = {}
  for node in range(entry.count):
    found = set()
    for allocation, offset, size, write in uses[node]:
      for other, o_offset, o_size, o_write in by_allocation.get(allocation, ()):
        if (write or o_write) and offset < o_offset + o_size \
            and o_offset < offset + size:
          found.add(other)
    for token, access in resources[node]:
      for other, o_write in by_resource.get(token, ()):
        if access == "write" or o_write:
          found.add(other)
    mask = 0
    for other in found:
      mask |= upstream[other] | (1 << other)
    upstream.append(mask)
    direct.append(sorted(found))
    for allocation, offset, size, write in uses[node]:
      by_allocation.setdefault(allocation, []).append((node, offset, size, write))
    for token, access in resources[node]:
      by_resource.setdefault(token, []).append((node, access == "write"))
  logged_up: list[int] = []
  for node, ins in entry.nodes.items():
    mask = 0
    for other in ins:
      mask |= logged_up[other] | (1 << other)
    logged_up.append(mask)
    if mask != upstream[node]:
      raise GraphLogError(
          f"the graph rebuilt from XLA's buffer assignment disagrees with "
          f"XLA's log at node {node} of {entry.count} (XLA's log format or "
          "rules are not the ones this version of jaxstreams reads)")
  return [tuple(j for j in found
                if not any((upstream[k] >> j) & 1 for k in found if k != j))
          for found in direct]


def _join(first: str, index: str | None) -> str:
  """Tuple index ``first`` followed by ``index`` (``{a,b}``), as XLA writes it."""
  rest = index[1:-1] if index and index != "{}" else ""
  return "{" + first + ("," + rest if rest else "") + "}"


class _BufferUses:
  """What each HLO instruction's kernel reads and writes, as slices
  ``(allocation, offset, size, writes)`` of XLA's buffer assignment."""

  def __init__(self, text: str, computations: dict):
    self.slices: dict[str, list[tuple[int, int, int, str]]] = {}
    allocation = None
    for line in text.splitlines():
      head = re.match(r"^allocation (\d+):", line)
      if head:
        allocation = int(head.group(1))
        continue
      value = re.match(r"^\s*value: <\d+ ([^\s{}@>]+)(\{[\d,]*\})?[^>]*> "
                       r"\(size=(\d+),offset=(\d+)\)", line)
      if value and allocation is not None:
        name, index, size, offset = value.groups()
        self.slices.setdefault(name, []).append(
            (allocation, int(offset), int(size), index or "{}"))
    self.instructions = {ins.name: ins for body in computations.values()
                         for ins in body}
    # A called computation's parameter k is operand k of its caller.
    self.callers: dict[str, Any] = {}
    for body in computations.values():
      for ins in body:
        if ins.called is not None:
          self.callers[ins.called] = ins
    self.computation_of = {ins.name: name for name, body in computations.items()
                           for ins in body}
    self.roots = {name: ins.name for name, body in computations.items()
                  for ins in body if ins.root}

  def of(self, name: str) -> list[tuple[int, int, int, bool]]:
    ins = self.instructions.get(name)
    if ins is None:
      raise GraphLogError(f"instruction {name!r} of a command is not in the "
                          "compiled HLO")
    writes = [(a, o, s, True) for a, o, s, _ in self.slices.get(name, ())]
    if not writes:
      raise GraphLogError(f"instruction {name!r} has no buffer in XLA's "
                          "buffer assignment")
    reads = [(a, o, s, False) for operand in ins.operands
             for a, o, s in self._resolve(operand, None)]
    return writes + reads

  def _resolve(self, name: str, index: str | None, depth: int = 0):
    """The slices holding value ``name`` (at tuple ``index``, or all)."""
    if depth > 64:
      raise GraphLogError(f"could not find the buffer of {name!r}")
    ins = self.instructions.get(name)
    if ins is not None and ins.opcode == "bitcast":
      return self._resolve(ins.operands[0], index, depth + 1)
    if ins is not None and ins.opcode == "get-tuple-element":
      k = re.search(r"\bindex=(\d+)", ins.attributes)
      return self._resolve(ins.operands[0], _join(k.group(1), index), depth + 1)
    if ins is not None and ins.opcode in ("call-done", "async-done"):
      return self._resolve(ins.operands[0], _join("1", index), depth + 1)
    if ins is not None and ins.opcode in ("call-start", "async-start") \
        and index not in (None, "{}"):
      first, _, rest = index[1:-1].partition(",")
      inner = "{" + rest + "}" if rest else None
      if first == "0":   # its operands, as passed
        k, _, rest = (rest or "").partition(",")
        if not k:
          raise GraphLogError(f"could not find the buffer of {name!r}{index}")
        return self._resolve(ins.operands[int(k)], "{" + rest + "}" if rest
                             else None, depth + 1)
      root = self.roots.get(ins.called or "")
      if first == "1" and root is not None:   # what its computation returns
        return self._resolve(root, inner, depth + 1)
    if ins is not None and ins.opcode == "tuple" and index not in (None, "{}"):
      first, _, rest = index[1:-1].partition(",")
      return self._resolve(ins.operands[int(first)], "{" + rest + "}" if rest
                           else None, depth + 1)
    if ins is not None and ins.opcode == "parameter" and name not in self.slices:
      caller = self.callers.get(self.computation_of.get(name))
      number = int(ins.operand_text.strip() or -1)
      if caller is None or not 0 <= number < len(caller.operands):
        raise GraphLogError(f"could not find the buffer of parameter {name!r}")
      return self._resolve(caller.operands[number], index, depth + 1)
    found = [(a, o, s) for a, o, s, i in self.slices.get(name, ())
             if index is None or i == index]
    if not found:
      raise GraphLogError(f"could not find the buffer of {name!r}{index or ''}")
    return found


# ---------------------------------------------------------------------------
# Compiling in a child process.

def xla_graphs(lowered: Any, *, target: Any = "h100",
               compiler_options: dict | None = None, plan=None,
               timeout: float = 600) -> XlaGraphs:
  """The CUDA graphs XLA:GPU builds for ``lowered``, compiled for a GPU in a
  child process: no GPU needed, and none of this process's devices used.
  The CUDA plugin must be installed at jaxlib's version (as for
  ``gpu_target``).

  ``lowered`` is a program lowered for CUDA: ``f.trace(*args).lower(
  lowering_platforms=("cuda",))`` on any machine, or ``f.lower(*args)`` of
  arguments on a GPU or on ``gpu_target(...).abstract``. It is compiled with
  the compiler options its own ``compile()`` would use, plus
  ``compiler_options``. ``target``: "h100" (default), "h200", the path of a
  GpuTargetConfigProto text file, or a ``GpuTarget``. With the function's
  ``plan``, ``compare()`` checks the plan's pairs of regions. A program
  partitioned over several devices is compiled for a node of that many
  GPUs; the graphs are one device's.
  """
  from jaxstreams.xla import target as targets
  if isinstance(target, targets.GpuTarget):
    name, config_text = target.name, target.config_text
  else:
    name, config_text = targets.target_config(target)
  options = {**_compat.lowered_compiler_options(lowered), **(compiler_options or {})}
  text = lowered.as_text(debug_info=True)
  partitions = re.search(r"mhlo\.num_partitions = (\d+)", text)
  request = json.dumps({"module": text,
                        "compiler_options": {k: _option_text(v) for k, v in options.items()},
                        "target_name": name, "target_config": config_text,
                        "devices": int(partitions.group(1)) if partitions else 1})
  package_root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="0",
             TF_CPP_VMODULE=LOG_MODULES,
             PYTHONPATH=os.pathsep.join(
                 [package_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  result = subprocess.run([sys.executable, "-m", "jaxstreams.xla._graph_child"],
                          input=request, env=env, capture_output=True,
                          text=True, timeout=timeout)
  if result.returncode != 0:
    raise GraphLogError(f"compiling for {name} in a child process failed "
                        f"(exit {result.returncode}):\n{result.stderr[-3000:]}")
  try:
    out = json.loads(result.stdout.strip().splitlines()[-1])
  except (ValueError, IndexError):
    raise GraphLogError("the child process printed no result:\n"
                        + result.stdout[-2000:]) from None
  return read_graphs(result.stderr, out["sequence"], out["metadata"],
                     out["hlo"], out.get("buffers"), plan)


def _option_text(value) -> Any:
  """A compiler option as the child passes it on (JSON has no enums)."""
  return value if isinstance(value, (bool, int, float, str)) else str(value)
