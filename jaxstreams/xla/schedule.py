"""What XLA:GPU will run: the schedule of a compiled program's async regions.

XLA:GPU turns each call that jaxstreams annotates with
``_xla_stream_annotation`` into a ``call-start`` / ``call-done`` pair; the
kernels on the region's stream run between the two, and whatever XLA's
scheduler places between them on the main stream (or in another region's
window) can run at the same time. The compiled module is scheduled
(``is_scheduled=true``): the entry computation's text order is its execution
order. ``xla_schedule`` reads that order; positions are order, never time.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

from jaxstreams._compat import XLA_SCHEDULES_STREAM_CALLS
from jaxstreams.lower.calls import REGION_ATTRIBUTE, STREAM_ANNOTATION

# Instructions that launch no kernel: they name, slice or group buffers.
_NO_KERNEL = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast",
    "call-start", "call-done", "async-start", "async-done", "async-update",
    "opt-barrier", "after-all", "partition-id", "replica-id", "iota",
})

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")


class HloParseError(ValueError):
  """The text is not the HLO module text of a compiled program."""


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str
  operand_text: str = ""    # the text between the opcode's parentheses
  root: bool = False        # its computation's ROOT
  shape: str = ""           # its result's shape as XLA writes it

  def frontend_attribute(self, key: str) -> str | None:
    match = re.search(rf'\b{re.escape(key)}="([^"]*)"', self.attributes)
    return match.group(1) if match else None

  @property
  def called(self) -> str | None:
    match = re.search(r"\b(?:calls|to_apply)=%?([\w.\-]+)", self.attributes)
    return match.group(1) if match else None


@dataclasses.dataclass(frozen=True)
class AsyncRegion:
  """One annotated call XLA runs on its own stream, from ``start`` to ``done``
  (positions in the entry computation's schedule)."""
  index: int
  name: str
  stream: int
  start: int
  done: int
  plan_region: int | None     # the StreamPlan region it came from, where known
  main_work: tuple[str, ...]  # main-stream kernels scheduled inside the window
  overlapping: tuple[int, ...]  # other regions in flight at the same time
  # a one-op wrapper XLA split off (e.g. a tuple element)
  fragment: bool = False

  @property
  def overlaps(self) -> bool:
    return bool(self.main_work or self.overlapping)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the entry computation, from ``start`` to ``done``
  (one position for a synchronous one), and the regions (``AsyncRegion``
  indices, fragments aside) in flight meanwhile: their kernels can run
  while it moves data; and the regions whose results it waits for (any
  chain of values from their done to its operands)."""
  name: str
  opcode: str
  start: int
  done: int
  regions_in_flight: tuple[int, ...]
  waits_for: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class PairCheck:
  """Two regions the plan lets run together, and whether XLA scheduled them
  so."""
  first: int       # plan region indices; -1 stands for main-stream work
  second: int
  # None: a region was not found in the schedule
  scheduled_together: bool | None


class XlaSchedule:
  """The async regions of a compiled program's entry computation, in order."""

  def __init__(self, instructions: Sequence[Instruction],
               regions: Sequence[AsyncRegion],
               synchronous: Sequence[Instruction], plan=None,
               collectives: Sequence[Collective] = ()):
    self.instructions = tuple(instructions)
    self.regions = tuple(regions)
    self.synchronous = tuple(synchronous)   # annotated calls left synchronous
    self.plan = plan                        # the StreamPlan matched, if given
    self.collectives = tuple(collectives)   # in schedule order

  @property
  def notes(self) -> tuple[str, ...]:
    """What XLA serialized that the plan lets run together (needs the plan),
    and the likely reason, one line each."""
    if self.plan is None:
      return ()
    notes = []
    for check in self.compare(self.plan):
      if check.scheduled_together is not False:
        continue
      if check.second == -1:
        notes.append(f"R{check.first}: no main-stream work it does not depend "
                     "on is scheduled inside its window")
      else:
        notes.append(f"R{check.first} and R{check.second} may run together; "
                     "XLA scheduled them one after the other")
    if not notes:
      return ()
    if not XLA_SCHEDULES_STREAM_CALLS:
      notes.append("this XLA (jax < 0.12) does not schedule stream regions "
                   "itself: only the order jaxstreams emits opens a window "
                   "(option jaxstreams_sequence_points)")
    elif self.peak_in_flight == 2:
      notes.append("XLA keeps at most xla_gpu_experimental_parallel_async_"
                   "compute_limit regions in flight (2 unless raised: pass it "
                   "in compiler_options of the outermost jit)")
    return tuple(notes)

  @property
  def main_regions(self) -> tuple[AsyncRegion, ...]:
    """The regions that are not fragments XLA split off."""
    return tuple(r for r in self.regions if not r.fragment)

  @property
  def peak_in_flight(self) -> int:
    """The most regions (fragments aside) started and not yet done at one
    point of the schedule."""
    events = sorted([(r.start, 1) for r in self.main_regions] +
                    [(r.done, -1) for r in self.main_regions])
    peak = current = 0
    for _, delta in events:
      current += delta
      peak = max(peak, current)
    return peak

  @property
  def overlapped(self) -> tuple[AsyncRegion, ...]:
    """The (non-fragment) regions with other work inside their windows."""
    return tuple(r for r in self.main_regions if r.overlaps)

  def summary(self) -> str:
    regions = self.main_regions
    text = (f"{len(regions)} async region(s) on stream(s) "
            f"{sorted({r.stream for r in regions})}, {len(self.overlapped)} "
            f"with work inside their window, peak {self.peak_in_flight} in "
            f"flight, {len(self.synchronous)} left synchronous, "
            f"{len(self.regions) - len(regions)} split-off fragment(s)")
    if self.collectives:
      beside = sum(bool(c.regions_in_flight) for c in self.collectives)
      text += (f"; {len(self.collectives)} collective(s), {beside} with a "
               "region in flight")
    return text

  def __str__(self) -> str:
    streams = sorted({r.stream for r in self.regions})
    columns = ["main"] + [f"stream {s}" for s in streams]
    starts = {r.start: r for r in self.regions}
    dones = {r.done: r for r in self.regions}
    rows = []
    open_regions: set[int] = set()
    for position, instruction in enumerate(self.instructions):
      cells = [""] * len(columns)
      if position in starts:
        region = starts[position]
        open_regions.add(region.index)
        cells[1 + streams.index(region.stream)] = f"{_label(region)} start"
      elif position in dones:
        region = dones[position]
        open_regions.discard(region.index)
        cells[1 + streams.index(region.stream)] = f"{_label(region)} done"
      elif (instruction.opcode not in _NO_KERNEL
            and instruction.opcode != "call"):
        cells[0] = instruction.name
      elif (instruction.opcode == "call"
            and instruction.frontend_attribute(STREAM_ANNOTATION)):
        cells[0] = (f"{instruction.name} (sync, stream "
                    f"{instruction.frontend_attribute(STREAM_ANNOTATION)})")
      else:
        continue
      for region in self.regions:
        column = 1 + streams.index(region.stream)
        if region.index in open_regions and not cells[column]:
          cells[column] = "|"
      rows.append([str(position)] + cells)
    header = ["pos"] + columns
    widths = [max(len(row[i]) for row in rows + [header])
              for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width)
                       for cell, width in zip(row, widths)).rstrip()
             for row in [header] + rows]
    notes = [f"note: {note}" for note in self.notes]
    return "\n".join([self.summary()] + lines + notes)

  def to_perfetto(self, path) -> None:
    """A Chrome/Perfetto trace of the schedule: one lane per stream, one unit
    of 'time' per position in the schedule (order, not time)."""
    events = []
    for position, instruction in enumerate(self.instructions):
      if instruction.opcode not in _NO_KERNEL and instruction.opcode != "call":
        events.append({"name": instruction.name, "ph": "X", "ts": position,
                       "dur": 1, "pid": 0, "tid": 0})
    for region in self.regions:
      events.append({"name": _label(region), "ph": "X", "ts": region.start,
                     "dur": region.done - region.start, "pid": 0,
                     "tid": region.stream,
                     "args": {"plan_region": region.plan_region,
                              "main_work": list(region.main_work)}})
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
              "args": {"name": "main" if tid == 0 else f"stream {tid}"}}
             for tid in sorted({0} | {r.stream for r in self.regions})]
    with open(path, "w") as f:
      json.dump({"traceEvents": names + events, "displayTimeUnit": "ns"}, f)

  def compare(self, plan) -> tuple[PairCheck, ...]:
    """For each pair the plan lets run together (two off-main regions on
    different streams, neither depending on the other; or an off-main region
    and main-stream work it does not depend on), whether XLA scheduled them
    together. Plan regions map to XLA regions as ``xla_schedule`` matched
    them (by the ``jaxstreams_region`` attribute)."""
    by_plan = {r.plan_region: r for r in self.main_regions
               if r.plan_region is not None}
    reach = _reachability(plan)
    calls = [r for r in plan.regions if r.is_call]
    mains = [r for r in plan.regions if not r.is_call]
    checks = []
    for i, a in enumerate(calls):
      if any(m.index not in reach[a.index] and a.index not in reach[m.index]
             for m in mains):
        found = by_plan.get(a.index)
        checks.append(PairCheck(
            a.index, -1, None if found is None else bool(found.main_work)))
      for b in calls[i + 1:]:
        if (a.stream == b.stream or b.index in reach[a.index]
            or a.index in reach[b.index]):
          continue
        x, y = by_plan.get(a.index), by_plan.get(b.index)
        together = None if x is None or y is None else y.index in x.overlapping
        checks.append(PairCheck(a.index, b.index, together))
    return tuple(checks)


def _label(region: AsyncRegion) -> str:
  return (f"R{region.plan_region}" if region.plan_region is not None
          else region.name) + (" (fragment)" if region.fragment else "")


def _reachability(plan) -> dict[int, set[int]]:
  """Regions each plan region reaches: through cross-stream dependencies and
  the order of regions on one stream."""
  successors: dict[int, set[int]] = {r.index: set() for r in plan.regions}
  for dependency in plan.dependencies:
    successors[dependency.producer].add(dependency.consumer)
  last_on_stream: dict[int, int] = {}
  for region in plan.regions:
    if region.stream in last_on_stream:
      successors[last_on_stream[region.stream]].add(region.index)
    last_on_stream[region.stream] = region.index
  reach: dict[int, set[int]] = {}
  for region in reversed(plan.regions):
    found = set()
    for successor in successors[region.index]:
      found.add(successor)
      found |= reach.get(successor, set())
    reach[region.index] = found
  return reach


def _split_shape(rest: str) -> tuple[str, str]:
  """``rest`` after ``name =``: its shape, and what follows."""
  rest = rest.lstrip()
  if rest.startswith("("):
    depth = 0
    for i, char in enumerate(rest):
      depth += char == "("
      depth -= char == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:]
    raise HloParseError(f"unbalanced parentheses in the shape of: {rest[:120]}")
  shape, _, after = rest.partition(" ")
  return shape, after


def parse_instruction(line: str) -> Instruction:
  match = _INSTRUCTION.match(line)
  if not match:
    raise HloParseError(f"not an HLO instruction: {line.strip()[:120]!r}")
  name, rest = match.groups()
  shape, after = _split_shape(rest)
  op_match = re.match(r"\s*([\w\-]+)\(", after)
  if not op_match:
    raise HloParseError(f"no opcode in HLO instruction: {line.strip()[:120]!r}")
  opcode = op_match.group(1)
  depth, index = 0, op_match.end() - 1
  for index in range(op_match.end() - 1, len(after)):
    depth += after[index] == "("
    depth -= after[index] == ")"
    if depth == 0:
      break
  else:
    raise HloParseError(f"unbalanced operand list in: {line.strip()[:120]!r}")
  operand_text = after[op_match.end():index]
  operands = tuple(re.findall(r"%([\w.\-]+)", operand_text))
  return Instruction(name, opcode, operands, after[index + 1:], operand_text,
                     line.lstrip().startswith("ROOT "), shape)


def _computations(text: str) -> tuple[str, dict[str, list[Instruction]]]:
  """The entry computation's name and every computation's instructions."""
  computations: dict[str, list[Instruction]] = {}
  entry = None
  current = None
  for number, line in enumerate(text.splitlines(), 1):
    stripped = line.strip()
    if not stripped or stripped.startswith(("HloModule", "//", "#")):
      continue
    if current is None:
      # Between computations: headers, and the module's FileNames /
      # StackFrames tables, which the schedule does not need.
      header = _COMPUTATION_HEADER.match(line)
      if header is None:
        continue
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
    elif stripped == "}" or stripped.startswith("},"):
      # '}, execution_thread=...'
      current = None
    else:
      try:
        computations[current].append(parse_instruction(line))
      except HloParseError as error:
        raise HloParseError(f"line {number}: {error}") from None
  if current is not None:
    raise HloParseError(f"computation {current!r} is not closed with '}}'")
  if entry is None:
    raise HloParseError("no ENTRY computation: give compiled.as_text() of a "
                        "compiled program, or the compiled executable itself")
  return entry, computations


def _match_plan(windows, plan) -> dict[int, int]:
  """Plan region of each (non-fragment) window: the one its
  ``jaxstreams_region`` attribute names, when that is a region on the same
  stream; else the next unmatched one on its stream, in order."""
  calls = {r.index: r.stream for r in plan.regions if r.is_call}
  matched: dict[int, int] = {}
  rest = []
  for k, (ins, _, _, fragment) in enumerate(windows):
    if fragment:
      continue
    stream = int(ins.frontend_attribute(STREAM_ANNOTATION))
    named = ins.frontend_attribute(REGION_ATTRIBUTE)
    if (named is not None and named.isdigit()
        and calls.get(int(named)) == stream):
      matched[k] = int(named)
    else:
      rest.append((k, stream))
  queues: dict[int, list[int]] = {}
  for index, stream in calls.items():
    if index not in matched.values():
      queues.setdefault(stream, []).append(index)
  for k, stream in rest:
    if queues.get(stream):
      matched[k] = queues[stream].pop(0)
  return matched


def xla_schedule(compiled: Any, plan=None) -> XlaSchedule:
  """The schedule XLA chose for ``compiled`` (a compiled executable, e.g.
  ``jaxstreams.jit(f).lower(...).compile()``, or its ``as_text()``). With the
  ``plan`` of the same function, each region is matched to the plan region
  its ``jaxstreams_region`` attribute names (by order on its stream where
  the attribute is missing, e.g. in hand-written ``compute_on`` programs)."""
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  if not isinstance(text, str) or not text.strip():
    raise HloParseError("expected HLO text or a compiled executable, got "
                        f"{type(compiled).__name__}")
  entry, computations = _computations(text)
  instructions = computations[entry]
  starts = [(i, ins) for i, ins in enumerate(instructions)
            if ins.opcode in ("call-start", "async-start")
            and ins.frontend_attribute(STREAM_ANNOTATION) is not None]
  done_of = {ins.operands[0]: i for i, ins in enumerate(instructions)
             if ins.opcode in ("call-done", "async-done") and ins.operands}
  windows = []
  for start, ins in starts:
    if ins.name not in done_of:
      raise HloParseError(f"{ins.opcode} {ins.name} has no matching done in "
                          "the entry computation")
    done = done_of[ins.name]
    body = computations.get(ins.called or "", [])
    fragment = bool(body) and all(b.opcode in _NO_KERNEL for b in body)
    windows.append((ins, start, done, fragment))
  plan_index = _match_plan(windows, plan) if plan is not None else {}
  regions = []
  for k, (ins, start, done, fragment) in enumerate(windows):
    main_work = tuple(instructions[p].name for p in range(start + 1, done)
                      if instructions[p].opcode not in _NO_KERNEL)
    # Fragments launch no kernel: being in flight beside one is no overlap.
    overlapping = tuple(j for j, (_, s, d, other_fragment) in enumerate(windows)
                        if j != k and not other_fragment and s < done
                        and start < d)
    regions.append(AsyncRegion(
        index=k, name=ins.name,
        stream=int(ins.frontend_attribute(STREAM_ANNOTATION)),
        start=start, done=done, plan_region=plan_index.get(k),
        main_work=main_work, overlapping=overlapping, fragment=fragment))
  synchronous = [ins for ins in instructions
                 if ins.opcode == "call"
                 and ins.frontend_attribute(STREAM_ANNOTATION) is not None]
  return XlaSchedule(instructions, regions, synchronous, plan,
                     _collectives(instructions, computations, regions))


# XLA's collective opcodes; each may also come as a "-start"/"-done" pair,
# or wrapped in an async-start / async-done pair.
_COLLECTIVES = frozenset({
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all",
    "ragged-all-to-all", "collective-permute", "collective-broadcast"})


def _collectives(instructions, computations, regions) -> list[Collective]:
  """The entry computation's collectives, each with the regions in flight
  during it."""
  def is_collective(ins) -> bool:
    base = ins.opcode.removesuffix("-start")
    if base in _COLLECTIVES:
      return True
    return ins.opcode == "async-start" and any(
        b.opcode in _COLLECTIVES
        for b in computations.get(ins.called or "", []))

  done_of = {ins.operands[0]: i for i, ins in enumerate(instructions)
             if ins.opcode.endswith("-done") and ins.operands}
  # Per instruction, the regions (bits) whose done is upstream of it: the
  # entry computation is scheduled, so operands come first.
  region_of_done = {r.done: r.index for r in regions if not r.fragment}
  upstream: dict[str, int] = {}
  found = []
  for position, ins in enumerate(instructions):
    mask = 0
    for operand in ins.operands:
      mask |= upstream.get(operand, 0)
    if position in region_of_done:
      mask |= 1 << region_of_done[position]
    upstream[ins.name] = mask
    if not is_collective(ins):
      continue
    done = (done_of.get(ins.name, position) if ins.opcode.endswith("-start")
            else position)
    in_flight = tuple(r.index for r in regions if not r.fragment
                      and r.start < done and position < r.done)
    waits = tuple(r.index for r in regions if mask >> r.index & 1)
    found.append(Collective(ins.name, ins.opcode, position, done, in_flight,
                            waits))
  return found
