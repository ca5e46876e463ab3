"""Reading what XLA:GPU writes while it compiles a program.

Nothing public reports what the GPU will launch. XLA writes it, when asked:

* its command-buffer log (``TF_CPP_VMODULE=command_executor=3``): for each
  CUDA graph, one line per command with the resources it reads and writes
  (the node's in-edges), then the node list;
* its thunk-sequence dump (``xla_dump_to``): every thunk the host runs, in
  order, nested (a command buffer's commands, an async call's body, a
  loop's condition and body, a conditional's branches), each named in the
  thunk-metadata dump by its HLO instruction;
* its buffer-assignment dump: which buffer slices each instruction writes
  and reads, from which the graph's edges are rebuilt where the log cut the
  node list short.

Text this version of jaxstreams does not understand is a ``GraphLogError``
saying what was expected, never a guess. ``jaxstreams.xla.launches`` builds
the model of the program from these; ``jaxstreams.xla.graph`` shows it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

_MODE = re.compile(r"CreateCommandOperations with synchronization mode: (\w+)")
_COMMAND = re.compile(r"command_executor\.cc:\d+\] (.*?)"
                      r"(?:\s+resources=\[(.*?)(\])?)?\s*$")
_GRAPH = re.compile(r"Execution graph: ExecutionGraph: (\d+) nodes, .*?"
                    r"is_sequential=(true|false)")
_NODE = re.compile(r"^node (\d+) \(priority=-?\d+\): in=\[(.*?)\] "
                   r"out=\[(.*?)\]\s*$")
_EDGE_ID = re.compile(r"id: (\d+)")
_CREATED = re.compile(r"Creating command buffer thunk(?: (\S+))? with the "
                      r"following thunks: (.*)$")
_DUMP_LINE = re.compile(r"^( *)(\d+): (k\w+)\s*\[[^\]]*\]\s?(.*)$")
# A section of a thunk's nested thunks: a loop's condition and body, a
# conditional's branches.
_SECTION = re.compile(r"^( *)([A-Za-z_][\w ]*?):\s*$")


class GraphLogError(RuntimeError):
  """XLA's command-buffer log (or thunk dump) is not in a form this version
  of jaxstreams understands; the message says what was expected."""


# ---------------------------------------------------------------------------
# The command-buffer log.

@dataclasses.dataclass
class LoggedGraph:
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


def parse_log(text: str) -> list[LoggedGraph]:
  """The graphs XLA's command-buffer log describes, in the order built."""
  graphs: list[LoggedGraph] = []
  current: LoggedGraph | None = None
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    line = lines[i]
    i += 1
    mode = _MODE.search(line)
    if mode:
      current = LoggedGraph(mode.group(1), [])
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


_COMMAND_TYPES = re.compile(r"Module (\S+) CommandBufferConfig: "
                            r"enabled_commands: \[([A-Z_, ]*)\]")


def command_types(text: str) -> tuple[str, ...] | None:
  """The command types XLA put into CUDA graphs for the program (what its
  conversion pass logs; a nested module of its own, ``Anonymous``, left
  out), sorted; None where the log does not say."""
  for module, types in _COMMAND_TYPES.findall(text):
    if module != "Anonymous":
      return tuple(sorted(t.strip() for t in types.split(",") if t.strip()))
  return None


# ---------------------------------------------------------------------------
# The thunk sequence.

@dataclasses.dataclass
class Thunk:
  """One thunk of XLA's dump: its id and kind (``kCustomKernel``,
  ``kCommandBuffer``, ``kWhile``, ...), the rest of its line, the HLO
  instruction it runs (from the metadata dump), the thunks nested in it
  (a command buffer's commands, an async call's body) and its named
  sections of thunks (a loop's ``condition`` and ``body``, a conditional's
  branches)."""
  id: int
  kind: str
  text: str
  annotation: str | None = None
  children: list["Thunk"] = dataclasses.field(default_factory=list)
  sections: dict[str, list["Thunk"]] = dataclasses.field(default_factory=dict)

  @property
  def name(self) -> str:
    """The command's name as XLA logs it: the first word of its text."""
    return self.text.split(" ", 1)[0]

  def commands(self):
    """As a command buffer's commands, in graph order: ``(command, the
    async start it runs in or None)``; an async call's body inlined, its
    start and done left out; a loop or conditional is one command."""
    for child in self.children:
      if child.kind == "kAsyncStart":
        for command, _ in child.commands():
          yield command, child
      elif child.kind not in ("kAsyncDone", "kSequential"):
        yield child, None
      elif child.kind == "kSequential":
        yield from child.commands()

  def walk(self):
    """This thunk and every thunk nested in it, depth first."""
    yield self
    for child in self.children:
      yield from child.walk()
    for section in self.sections.values():
      for thunk in section:
        yield from thunk.walk()


def parse_thunk_dump(sequence: str, metadata: str | None) -> list[Thunk]:
  """XLA's thunk-sequence dump: its top-level thunks, the nested ones as
  children or in named sections, each named by its HLO instruction from the
  thunk-metadata dump."""
  names: dict[int, str] = {}
  if metadata:
    for block in re.findall(r"thunk_info \{(.*?)\}", metadata, re.S):
      annotation = re.search(r'profile_annotation: "([^"]*)"', block)
      ident = re.search(r"thunk_id: (\d+)", block)
      if annotation and ident:
        names[int(ident.group(1))] = annotation.group(1)
  roots: list[Thunk] = []
  # Open containers, innermost last: (indent of their line, list to append
  # to, the thunk they belong to).
  stack: list[tuple[int, list[Thunk], Thunk | None]] = [(-1, roots, None)]
  last: list[tuple[int, Thunk]] = []   # thunks seen, with their indent
  for line in sequence.splitlines():
    if not line.strip() or line.strip() == "No thunks.":   # an empty body
      continue
    match = _DUMP_LINE.match(line)
    if match is None:
      section = _SECTION.match(line)
      if section is None:
        raise GraphLogError(f"a thunk dump line not understood: {line[:160]!r}")
      indent = len(section.group(1))
      # The section belongs to the last thunk at or left of its indent.
      owner = next((t for i, t in reversed(last) if i <= indent), None)
      if owner is None:
        raise GraphLogError(f"a thunk dump section with no thunk: {line!r}")
      owner_indent = next(i for i, t in reversed(last) if t is owner)
      while stack[-1][0] >= owner_indent and stack[-1][2] is not owner:
        stack.pop()
      if stack[-1][2] is owner:
        stack.pop()
      body = owner.sections.setdefault(section.group(2), [])
      stack.append((owner_indent, body, owner))
      continue
    indent, ident, kind, text = match.groups()
    thunk = Thunk(int(ident), kind, text.strip(), names.get(int(ident)))
    depth = len(indent)
    while stack[-1][0] >= depth:
      stack.pop()
    owner = stack[-1][2]
    if owner is not None and stack[-1][1] is not owner.children and \
        not any(stack[-1][1] is s for s in owner.sections.values()):
      raise GraphLogError(f"a thunk dump line out of place: {line[:160]!r}")
    stack[-1][1].append(thunk)
    stack.append((depth, thunk.children, thunk))
    last.append((depth, thunk))
  return roots


# ---------------------------------------------------------------------------
# The buffer assignment, and graph edges rebuilt from it.

def graph_edges(entry: LoggedGraph, instructions: Sequence[str | None],
           buffers_of: "BufferUses | None") -> list[tuple[int, ...]]:
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
      by_allocation.setdefault(allocation, []).append(
          (node, offset, size, write))
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
  """Tuple index ``first`` followed by ``index`` (``{a,b}``), as XLA writes
  it."""
  rest = index[1:-1] if index and index != "{}" else ""
  return "{" + first + ("," + rest if rest else "") + "}"


class BufferUses:
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
    if (ins is not None and ins.opcode == "parameter"
        and name not in self.slices):
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
