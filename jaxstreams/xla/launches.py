"""What the GPU launches: the model of a compiled program, per stream, in order.

One host thread walks a compiled program's thunks in order and launches,
on XLA's streams: CUDA graphs (most of a step, where XLA can capture it),
kernels one by one (what it cannot: loops' bodies, convolutions unless
enabled, work in a stream call left out of the graphs), library calls,
copies, loops (the host launches the body again for each step; where XLA
does not know the trip count it copies the loop's predicate to the host and
waits for it every step), conditionals (outside a graph the host waits for
the branch index) and stream calls (a window on another stream, from the
call's start to its done). ``read_program`` builds that, from what
``jaxstreams.xla.xla_logs`` reads, with each launch's plan region where
known; ``GpuProgram.parallel_regions`` says which regions' work is in
flight together, inside graphs and across graphs and streams.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator, Mapping, Sequence, Union

from jaxstreams.lower.calls import REGION_ATTRIBUTE
from jaxstreams.lower.calls import REGION_SCOPE
from jaxstreams.xla.schedule import HloParseError, _computations
from jaxstreams.xla.work import Work, arrays, instruction_work
from jaxstreams.xla.xla_logs import (BufferUses, GraphLogError, LoggedGraph,
                                     Thunk, graph_edges, parse_log,
                                     parse_thunk_dump)

# Kernels of regions emitted in place are found by emit's name scope.
_REGION_SCOPE_RE = re.compile(
    re.escape(REGION_SCOPE).replace(re.escape("{index}"), r"(\d+)"))
_STREAM_OF_START = re.compile(r"stream=\w+\[(\d+)\]")
_ASYNC_ID = re.compile(r"async_id=(\d+)")
_GRID = re.compile(r"grid: \[(\d+), (\d+), (\d+)\] threads: "
                   r"\[(\d+), (\d+), (\d+)\]")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')

# What a thunk that is not a kernel launches, by XLA's thunk kind.
_KINDS = {
    "kKernel": "kernel", "kCustomKernel": "kernel",
    "kTriangularSolve": "kernel",
    "kCopy": "copy", "kDeviceToDevice": "copy", "kDynamicSliceFusion": "copy",
    "kMemset32bitValue": "memset", "kMemzero": "memset",
    "kGemm": "cuBLAS", "kCublasLtMatmul": "cuBLAS",
    "kConvolution": "cuDNN", "kCuDnn": "cuDNN", "kNorm": "cuDNN",
    "kCustomCall": "custom call", "kFfi": "custom call",
    "kHostToDevice": "host copy", "kDeviceToHost": "host copy",
    "kHostSend": "host copy", "kHostRecv": "host copy",
}


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
  # Thread blocks and threads per block (None: a library call, a copy).
  launch: tuple[int, int] | None = None


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
    return tuple(sorted({k.region for k in self.kernels
                         if k.region is not None}))

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
class KernelLaunch:
  """One launch outside any CUDA graph: a kernel, a copy, a library call
  (cuBLAS, cuDNN), a custom call, a collective."""
  name: str
  kind: str                   # kernel, copy, memset, cuBLAS, cuDNN, ...
  thunk: str                  # XLA's thunk kind
  instruction: str | None
  region: int | None
  stream: int
  # Thread blocks and threads per block, where XLA launches a kernel.
  launch: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class GraphLaunch:
  """A CUDA graph launched on ``stream``; ``nested``: its conditional and
  loop commands, whose branches and bodies are graphs of their own that the
  GPU runs without the host."""
  graph: CudaGraph
  stream: int
  nested: tuple["Launch", ...] = ()


@dataclasses.dataclass(frozen=True)
class StreamCall:
  """An annotated call outside the graphs: its start waits for an event of
  the stream that launches it and runs its launches on its own stream;
  ``window`` is how many of the launches after it in the same sequence are
  made before its done makes the launching stream wait."""
  instruction: str | None
  region: int | None
  stream: int
  launches: tuple["Launch", ...]
  window: int
  planned: bool = True        # a region jaxstreams emitted, not XLA's own
                              # asynchronous work (a copy it overlaps)


@dataclasses.dataclass(frozen=True)
class Loop:
  """A loop: the host launches ``body`` once a step. ``trip_count`` where
  XLA knows it; otherwise the host copies the loop's predicate back and
  waits for it every step (``host_waits``)."""
  instruction: str | None
  trip_count: int | None
  host_waits: bool
  condition: tuple["Launch", ...]
  body: tuple["Launch", ...]
  stream: int


@dataclasses.dataclass(frozen=True)
class Conditional:
  """A conditional: outside a graph the host reads the branch index back
  and waits for it (``host_waits``), then launches the branch."""
  instruction: str | None
  branches: tuple[tuple["Launch", ...], ...]
  host_waits: bool
  stream: int


Launch = Union[KernelLaunch, GraphLaunch, StreamCall, Loop, Conditional]


@dataclasses.dataclass(frozen=True)
class GpuProgram:
  """What the GPU launches for one compiled program: ``launches`` in the
  order the host makes them, and every CUDA graph among them (loop bodies
  and conditional branches included); ``work``: what each HLO instruction
  that launches something does (``work.Work``); ``arguments`` and
  ``results``: the program's buffers in and out, counted."""
  launches: tuple[Launch, ...]
  graphs: tuple[CudaGraph, ...]
  work: Mapping[str, Work] = dataclasses.field(default_factory=dict)
  arguments: int = 0
  results: int = 0

  def walk(self) -> Iterator[Launch]:
    """Every launch, nested ones (loop bodies, branches, stream calls)
    after the launch that holds them."""
    return _walk(self.launches)

  def parallel_regions(self) -> tuple[tuple[int, int], ...]:
    """Pairs of plan regions whose work can be in flight at the same time:
    parallel branches of a graph, or one in a stream call's window while
    the other's work is launched on another stream."""
    pairs = {p for g in self.graphs for p in g.parallel_regions()}
    pairs |= _windows_together(self.launches)
    return tuple(sorted(pairs))

  @property
  def loose_kernels(self) -> tuple[KernelLaunch, ...]:
    """The launches made one by one, outside any graph."""
    return tuple(l for l in self.walk() if isinstance(l, KernelLaunch))

  def to_json(self) -> dict:
    """This program as plain data (``from_json`` reads it back): what the
    step-time fit keeps of each compiled program."""
    return _plain(self)

  @classmethod
  def from_json(cls, data: dict) -> "GpuProgram":
    return _unplain(data)


_TYPES = {t.__name__: t for t in (Kernel, CudaGraph, KernelLaunch, GraphLaunch,
                                  StreamCall, Loop, Conditional)}


def _plain(value):
  if isinstance(value, GpuProgram):
    return {"launches": _plain(value.launches), "graphs": _plain(value.graphs),
            "work": {k: dataclasses.astuple(w) for k, w in value.work.items()},
            "arguments": value.arguments, "results": value.results}
  if dataclasses.is_dataclass(value):
    return {"type": type(value).__name__,
            **{f.name: _plain(getattr(value, f.name))
               for f in dataclasses.fields(value)}}
  if isinstance(value, (tuple, list)):
    return [_plain(v) for v in value]
  return value


def _unplain(value):
  if isinstance(value, dict) and "launches" in value and "type" not in value:
    return GpuProgram(_unplain(value["launches"]), _unplain(value["graphs"]),
                      {k: Work(*w) for k, w in value["work"].items()},
                      value["arguments"], value["results"])
  if isinstance(value, dict):
    kind = _TYPES[value["type"]]
    return kind(**{k: _unplain(v) for k, v in value.items() if k != "type"})
  if isinstance(value, list):
    return tuple(_unplain(v) for v in value)
  return value


def _walk(launches) -> Iterator[Launch]:
  for launch in launches:
    yield launch
    for inner in _inner(launch):
      yield from _walk(inner)


def _inner(launch) -> tuple[tuple[Launch, ...], ...]:
  if isinstance(launch, GraphLaunch):
    return (launch.nested,)
  if isinstance(launch, StreamCall):
    return (launch.launches,)
  if isinstance(launch, Loop):
    return (launch.condition, launch.body)
  if isinstance(launch, Conditional):
    return launch.branches
  return ()


def regions_in(launch) -> set[int]:
  """The plan regions with work in ``launch``, nested launches included."""
  if isinstance(launch, KernelLaunch):
    return {launch.region} if launch.region is not None else set()
  found = set()
  if isinstance(launch, GraphLaunch):
    found |= set(launch.graph.regions)
  if isinstance(launch, StreamCall) and launch.region is not None:
    found.add(launch.region)
  for inner in _inner(launch):
    for nested in inner:
      found |= regions_in(nested)
  return found


def _windows_together(launches) -> set[tuple[int, int]]:
  """Pairs in flight together through stream calls' windows, in
  ``launches`` and the sequences nested in them."""
  pairs: set[tuple[int, int]] = set()
  for i, launch in enumerate(launches):
    if (isinstance(launch, StreamCall) and launch.planned
        and launch.region is not None):
      for other in launches[i + 1:i + 1 + launch.window]:
        if getattr(other, "stream", None) == launch.stream:
          continue
        pairs.update(tuple(sorted((launch.region, r)))
                     for r in regions_in(other) if r != launch.region)
    for inner in _inner(launch):
      pairs |= _windows_together(inner)
  return pairs


# ---------------------------------------------------------------------------
# Building the model.

def read_program(log: str, sequence: str | None, metadata: str | None,
                 hlo: str, buffers: str | None = None) -> GpuProgram:
  """The program XLA compiled, from its command-buffer log, its thunk
  dump, its compiled HLO text and (for graphs whose node list the log cut
  short) its buffer-assignment dump."""
  logged = parse_log(log)
  try:
    entry, computations = _computations(hlo)
  except HloParseError as error:
    raise GraphLogError(
        f"the compiled HLO could not be read: {error}") from None
  builder = _Builder(computations, BufferUses(buffers, computations)
                     if buffers else None)
  roots = parse_thunk_dump(sequence, metadata) if sequence else []
  builder.match_graphs(logged, roots)
  return GpuProgram(builder.sequence(roots, stream=0, in_graph=False),
                    tuple(builder.graphs), instruction_work(computations),
                    *_buffers(computations[entry]))


def _buffers(entry) -> tuple[int, int]:
  """The entry computation's arguments and results, counted."""
  parameters = sum(ins.opcode == "parameter" for ins in entry)
  root = next((ins for ins in entry if ins.root), None)
  return parameters, len(arrays(root.shape)) if root is not None else 0


class _Builder:
  """Turns thunks into launches: regions from the compiled HLO, graphs from
  XLA's log matched to the command buffers that run them."""

  def __init__(self, computations, buffers_of):
    self.instructions = {ins.name: ins for body in computations.values()
                         for ins in body}
    self.buffers_of = buffers_of
    self.graph_of: dict[int, CudaGraph] = {}   # id(command list) -> graph
    self.graphs: list[CudaGraph] = []

  def region_of(self, instruction: str | None) -> int | None:
    ins = self.instructions.get(instruction or "")
    if ins is None:
      return None
    value = ins.frontend_attribute(REGION_ATTRIBUTE)
    if value is not None:
      return int(value) if value.isdigit() else None
    match = _REGION_SCOPE_RE.search(ins.attributes)
    return int(match.group(1)) if match else None

  # -- graphs ----------------------------------------------------------------

  def match_graphs(self, logged: Sequence[LoggedGraph], roots) -> None:
    """Each graph XLA logged, matched to the command list it runs: a
    command buffer's, or inside one, a conditional's branch or a loop's
    body or condition (XLA builds those as graphs of their own)."""
    candidates: list[list[Thunk]] = []
    for root in roots:
      for thunk in root.walk():
        if thunk.kind == "kCommandBuffer":
          candidates.append(thunk.children)
          for inner in thunk.walk():
            if inner is not thunk:
              candidates.extend(inner.sections.values())
    unused = list(range(len(candidates)))
    for index, entry in enumerate(logged):
      names = [_command_name(text) for text, _ in entry.commands]
      commands = None
      for c in unused:
        found = list(_commands(candidates[c]))
        if [cmd.name for cmd, _ in found] == names:
          commands = found
          self.graph_of[id(candidates[c])] = index
          unused.remove(c)
          break
      if commands is None and roots and entry.thunks:
        raise GraphLogError(
            f"no command buffer in XLA's thunk dump holds the {entry.count} "
            f"commands of graph {index} ({', '.join(names[:4])}, ...): the "
            "kernels could not be matched to HLO instructions")
      self.graphs.append(self._graph(index, entry, commands))
    self.graph_of = {key: self.graphs[i] for key, i in self.graph_of.items()}

  def _graph(self, index: int, entry: LoggedGraph, commands) -> CudaGraph:
    placed = []
    for node, (text, _) in enumerate(entry.commands):
      instruction, region, stream = None, None, 0
      if commands is not None:
        command, start = commands[node]
        instruction = command.annotation
        if start is not None:
          stream = _stream_of(start)
          region = self.region_of(start.annotation)
        if region is None:
          region = self.region_of(instruction)
      placed.append((_command_name(text), instruction, region, stream))
    inputs = graph_edges(entry, [p[1] for p in placed], self.buffers_of)
    kernels = tuple(Kernel(node, name, instruction, region, stream,
                           inputs[node], launch_of(entry.commands[node][0]))
                    for node, (name, instruction, region, stream)
                    in enumerate(placed))
    return CudaGraph(index, entry.name, entry.mode, kernels, entry.sequential)

  # -- launches ----------------------------------------------------------------

  def sequence(self, thunks: Sequence[Thunk], stream: int,
               in_graph: bool) -> tuple[Launch, ...]:
    """The launches of ``thunks`` run in order on ``stream``."""
    launches: list[Launch] = []
    opened: dict[str, int] = {}   # async id -> index of its StreamCall
    for thunk in thunks:
      if thunk.kind == "kAsyncDone":
        match = _ASYNC_ID.search(thunk.text)
        at = opened.pop(match.group(1), None) if match else None
        if at is not None:
          call = launches[at]
          launches[at] = dataclasses.replace(
              call, window=len(launches) - at - 1)
        continue
      if thunk.kind == "kSequential":
        launches.extend(self.sequence(thunk.children, stream, in_graph))
        continue
      launch = self.launch(thunk, stream, in_graph)
      if isinstance(launch, StreamCall):
        match = _ASYNC_ID.search(thunk.text)
        if match:
          opened[match.group(1)] = len(launches)
      launches.append(launch)
    return tuple(launches)

  def launch(self, thunk: Thunk, stream: int, in_graph: bool) -> Launch:
    if thunk.kind == "kCommandBuffer":
      graph = self.graph_of.get(id(thunk.children))
      if graph is None:   # a command buffer XLA logged no graph for
        return StreamCall(None, None, stream,
                          self.sequence(thunk.children, stream, in_graph), 0)
      return GraphLaunch(graph, stream, tuple(
          self.launch(command, stream, in_graph=True)
          for command, _ in thunk.commands()
          if command.kind in ("kConditional", "kWhile")))
    if thunk.kind == "kAsyncStart":
      own = _stream_of(thunk)
      start = self.instructions.get(thunk.annotation or "")
      planned = (start is not None
                 and start.frontend_attribute(REGION_ATTRIBUTE) is not None)
      return StreamCall(thunk.annotation, self.region_of(thunk.annotation),
                        own, self.sequence(thunk.children, own, in_graph),
                        window=0, planned=planned)
    if thunk.kind == "kWhile":
      ins = self.instructions.get(thunk.annotation or "")
      trip = _TRIP_COUNT.search(ins.attributes) if ins is not None else None
      return Loop(thunk.annotation, int(trip.group(1)) if trip else None,
                  host_waits=trip is None and not in_graph,
                  condition=self.sequence(thunk.sections.get("condition", ()),
                                          stream, in_graph),
                  body=self.sequence(thunk.sections.get("body", ()), stream,
                                     in_graph),
                  stream=stream)
    if thunk.kind == "kConditional":
      return Conditional(thunk.annotation, tuple(
          self._branch(section, stream, in_graph)
          for section in thunk.sections.values()), host_waits=not in_graph,
          stream=stream)
    return KernelLaunch(thunk.name,
                        _KINDS.get(thunk.kind, thunk.kind[1:]), thunk.kind,
                        thunk.annotation, self.region_of(thunk.annotation),
                        stream, launch_of(thunk.text))

  def _branch(self, section, stream, in_graph) -> tuple[Launch, ...]:
    graph = self.graph_of.get(id(section))
    if graph is not None:
      return (GraphLaunch(graph, stream),)
    return self.sequence(section, stream, in_graph)


def _commands(thunks: Sequence[Thunk]):
  """A command list's commands in graph order, with the async start each
  runs in (see ``Thunk.commands``)."""
  holder = Thunk(-1, "kCommandBuffer", "", children=list(thunks))
  return holder.commands()


def launch_of(text: str) -> tuple[int, int] | None:
  """The thread blocks and threads per block of a kernel launch as XLA
  writes it (``grid: [x, y, z] threads: [x, y, z]``), None where the text
  has none."""
  match = _GRID.search(text)
  if match is None:
    return None
  sizes = [int(x) for x in match.groups()]
  return sizes[0] * sizes[1] * sizes[2], sizes[3] * sizes[4] * sizes[5]


def _command_name(text: str) -> str:
  return text.split(" ", 1)[0]


def _stream_of(start: Thunk) -> int:
  match = _STREAM_OF_START.search(start.text)
  return int(match.group(1)) if match else 0


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
