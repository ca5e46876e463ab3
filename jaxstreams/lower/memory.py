"""Device memory of the ways: what XLA says a compiled program needs, what
the device has free, and whether a way fits.

Running work side by side costs device memory, and the ways differ (XLA's
memory analysis of deviceless H100 compiles, docs/xla.md): CONCURRENT
graphs keep the buffers of kernels that may run at once apart (same HLO,
same schedule, more temporary bytes), stream calls and a group's one loop
keep each side's working set alive together. Nothing here guesses what
XLA will allocate; the numbers are XLA's own (``Footprint``, from
``compiled.memory_analysis()``), and the limit is the device's own
(``free_bytes``, which tests replace to pretend a small device).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from jaxstreams import _compat
from jaxstreams.lower.emit import FUSING_PROGRAMS, emits_inline
from jaxstreams.tag.read import sub_jaxprs


@dataclasses.dataclass(frozen=True)
class Footprint:
  """XLA's memory analysis of one compiled program, in bytes: its
  temporaries, arguments, outputs, the outputs that reuse an argument's
  buffer (donation), and its generated code."""
  temp: int
  arguments: int
  outputs: int
  alias: int = 0
  code: int = 0

  @property
  def needed(self) -> int:
    """Bytes a call needs on the device: its arguments, temporaries and
    outputs, less the outputs that reuse donated arguments."""
    return self.arguments + self.outputs + self.temp - self.alias

  @classmethod
  def of(cls, stats) -> "Footprint":
    """From XLA's ``CompiledMemoryStats`` (``compiled.memory_analysis()``)."""
    return cls(int(stats.temp_size_in_bytes), int(stats.argument_size_in_bytes),
               int(stats.output_size_in_bytes), int(stats.alias_size_in_bytes),
               int(getattr(stats, "generated_code_size_in_bytes", 0) or 0))

  def as_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self)

  def describe(self) -> str:
    return (f"{bytes_text(self.needed)} for a call: temporaries "
            f"{bytes_text(self.temp)}, arguments {bytes_text(self.arguments)}, "
            f"outputs {bytes_text(self.outputs)}"
            + (f", {bytes_text(self.alias)} of them donated" if self.alias
               else "")
            + (f"; code {bytes_text(self.code)}" if self.code else ""))


def footprint(compiled) -> Footprint | None:
  """XLA's memory analysis of ``compiled`` (a ``jax.stages.Compiled``);
  None where the backend does not say."""
  try:
    stats = compiled.memory_analysis()
  except Exception:   # not every backend implements it
    return None
  return None if stats is None else Footprint.of(stats)


def free_bytes(device) -> int | None:
  """The device's free memory now (its allocator's limit less what is in
  use); None where it has no such statistics (a CPU, a compile target's
  device). The one reading of the limit: tests replace it."""
  try:
    stats = device.memory_stats()
  except Exception:   # a compile target's device, or no statistics
    return None
  if not stats or "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def too_big(needed: Mapping[str, int | None], free: int | None
            ) -> dict[str, str]:
  """The ways (of ``needed``: way -> bytes) that would not fit in ``free``
  bytes, and why."""
  if free is None:
    return {}
  return {w: f"needs {bytes_text(m)}, {bytes_text(free)} free"
          for w, m in needed.items() if m is not None and m > free}


def overflow(way: str, compile: Callable[[], object], device) -> str | None:
  """Why ``way``'s program would not fit in ``device``'s free memory, where
  it would not; None where it fits, or where the device does not say what
  is free (then nothing is compiled). ``compile()`` gives the compiled
  program, whose memory analysis is read."""
  free = free_bytes(device)
  if free is None:
    return None
  try:
    found = footprint(compile())
  except Exception:  # noqa: BLE001 - the call itself reports it, as jax.jit
    return None
  if found is None or found.needed <= free:
    return None
  return (f"{way!r} needs {bytes_text(found.needed)} on the device, "
          f"{bytes_text(free)} free: jax.jit's program instead")


def bytes_text(n: float) -> str:
  """Bytes for people: MiB (GiB from 10 GiB, KiB under 1 MiB, bytes
  under 1 KiB)."""
  if n >= 10 * 2**30:
    return f"{n / 2**30:.1f} GiB"
  if n >= 2**20 or n == 0:
    return f"{n / 2**20:.1f} MiB"
  if n >= 2**10:
    return f"{n / 2**10:.1f} KiB"
  return f"{int(n)} B"


def ratio_text(bytes_: int | None, baseline: int | None) -> str:
  """``bytes_`` as a multiple of ``baseline`` ("1.41x"), or "?"."""
  if bytes_ is None or not baseline:
    return "?"
  return f"{bytes_ / baseline:.2f}x"


# ---------------------------------------------------------------------------
# What each way costs, as the plan states it.

@dataclasses.dataclass(frozen=True)
class WayMemory:
  """One way's program and what it needs on the device: ``footprint``
  (XLA's memory analysis, where compiled), ``needed`` (bytes a call needs;
  from the footprint, or a timed candidate's figure), ``graphs`` (the view
  of what a GPU launches for it, ``XlaGraphs``, where compiled for a
  target), ``seconds`` (its estimated step time, where an estimate of the
  view exists) and ``note`` (why a figure is missing)."""
  way: str
  nested: bool = False       # the program of a call inside another jit
  footprint: Footprint | None = None
  needed: int | None = None
  graphs: object = None
  seconds: float | None = None
  note: str = ""

  def __post_init__(self):
    if self.needed is None and self.footprint is not None:
      object.__setattr__(self, "needed", self.footprint.needed)

  @property
  def label(self) -> str:
    return self.way + (" (inside another jit)" if self.nested else "")


@dataclasses.dataclass(frozen=True)
class WaysMemory:
  """What each way of one signature needs on the device, against the
  program ``jax.jit`` builds (``inline``), and where the figures come from
  (``source``)."""
  source: str
  ways: tuple[WayMemory, ...]

  def get(self, way: str, nested: bool = False) -> WayMemory | None:
    return next((w for w in self.ways if w.way == way and w.nested == nested),
                None)

  @property
  def baseline(self) -> WayMemory | None:
    return self.get("inline")

  def ratio(self, way: str, nested: bool = False) -> float | None:
    """A way's bytes for a call as a multiple of jax.jit's program's."""
    found, base = self.get(way, nested), self.baseline
    if found is None or base is None or not found.needed or not base.needed:
      return None
    return found.needed / base.needed

  def lines(self) -> list[str]:
    """The table ``str(plan)`` prints."""
    base = self.baseline
    base_temp = base.footprint.temp if base and base.footprint else None
    rows = []
    for w in self.ways:
      f = w.footprint
      cells = [w.label,
               bytes_text(f.temp) if f else "-",
               bytes_text(f.arguments) if f else "-",
               bytes_text(f.outputs) if f else "-",
               bytes_text(w.needed) if w.needed is not None else "-",
               ratio_text(w.needed, base.needed if base else None),
               ratio_text(f.temp if f else None, base_temp)]
      if any(x.seconds is not None for x in self.ways):
        cells.append(f"{w.seconds * 1e6:.1f} us" if w.seconds is not None
                     else "-")
      rows.append(cells)
    header = ["way", "temporaries", "arguments", "outputs", "for a call",
              "vs jax.jit", "temporaries vs jax.jit"]
    if any(x.seconds is not None for x in self.ways):
      header.append("GPU step est.")
    widths = [max(len(h), *(len(r[i]) for r in rows))
              for i, h in enumerate(header)]
    fmt = lambda cells: "  " + "  ".join(
        c.ljust(n) for c, n in zip(cells, widths)).rstrip()
    lines = [f"device memory of each way ({self.source}; jax.jit's program "
             "is 'inline'):", fmt(header)] + [fmt(r) for r in rows]
    lines += [f"  {w.label}: {w.note}" for w in self.ways if w.note]
    if any(x.seconds is not None for x in self.ways):
      lines.append("  GPU step est.: the GPU step estimate of the way's "
                   "program on the target (jaxstreams.xla.step_time), not a "
                   "timing, nor the planner's makespan")
    return lines


def measured(decision, footprints: Mapping[str, Footprint | None]
             ) -> WaysMemory | None:
  """What the candidates a GPU compiled and timed for a signature needed
  (``decision``: its ``timing.Decision``, whose trials carry each way's
  bytes; ``footprints``: XLA's analyses, where this process compiled
  them), or None where no figure was taken."""
  if not any(t.memory_bytes is not None for t in decision.trials):
    return None
  where = ("kept on disk from an earlier run" if decision.cached
           else "this signature's")
  return WaysMemory(
      f"XLA's memory analysis of the candidates compiled on this GPU, {where}",
      tuple(WayMemory(t.way, footprint=footprints.get(t.way),
                      needed=t.memory_bytes, note=t.skipped)
            for t in decision.trials))


# ---------------------------------------------------------------------------
# Inside another jit: nothing is compiled to check, so a bound.

# Inside another jit, the default runs work side by side only where the
# bound of what that adds is at most this share of the device's free memory.
NESTED_SHARE = 0.1


@dataclasses.dataclass(frozen=True)
class NestedCheck:
  """Whether a program of a call traced inside another jit fits: ``extra``,
  a bound of the bytes it may hold beyond ``jax.jit``'s program
  (``extra_bound``), against ``NESTED_SHARE`` of ``free`` (the device's free
  memory at trace time; None: no GPU here, nothing to check)."""
  program: str
  extra: int
  free: int | None
  copies: int = 1    # under jax.vmap, the program runs this many at once

  @property
  def budget(self) -> int | None:
    return None if self.free is None else int(NESTED_SHARE * self.free)

  @property
  def fits(self) -> bool:
    return self.budget is None or self.extra * self.copies <= self.budget

  def describe(self) -> str:
    bound = (f"at most {bytes_text(self.extra)} beyond jax.jit's program "
             "(a bound")
    bound += (f"; {self.copies} at once under jax.vmap)" if self.copies > 1
              else ")")
    if self.free is None:
      return (f"{bound}; not checked: no GPU here (on one, it must be within "
              f"{NESTED_SHARE:.0%} of the free memory)")
    within = (f"within {NESTED_SHARE:.0%} of the device's "
              f"{bytes_text(self.free)} free")
    if self.fits:
      return f"{bound}, {within}"
    return (f"{bound}, more than {NESTED_SHARE:.0%} of the device's "
            f"{bytes_text(self.free)} free: jax.jit's program instead")


def vmapped_copies(leaves) -> int:
  """How many copies of a function's program run as one when it is called
  with ``leaves`` under ``jax.vmap``: the product of the mapped axes'
  sizes, nested vmaps multiplied (1 outside vmap). jax's vmap tracer
  (``_compat.BatchTracer``) holds the value with the mapped axis (``val``,
  itself a tracer under nested vmaps) and where it is (``batch_dim``; not
  an int where the value is not mapped): the same on jax 0.10.2 to
  0.12.0.1, which tests/test_memory.py holds."""
  most = 1
  for leaf in leaves:
    copies = 1
    while isinstance(leaf, _compat.BatchTracer):
      if isinstance(leaf.batch_dim, int):
        copies *= int(leaf.val.shape[leaf.batch_dim])
      leaf = leaf.val
    most = max(most, copies)
  return most


def default_device():
  """The device a program traced now runs on unless its arguments say
  otherwise: jax's default."""
  import jax
  return jax.devices()[0]


def nested_check(partitioned, program: str, device,
                 copies: int = 1) -> NestedCheck:
  """``NestedCheck`` of ``program`` (what ``emit`` builds: "loops",
  "streams", ...) for ``partitioned`` (a ``PartitionedProgram``) on
  ``device`` (where the outer program runs; its free memory now), run
  ``copies`` at once (``jax.vmap``)."""
  return NestedCheck(program, extra_bound(partitioned, program),
                     free_bytes(device) if device is not None else None,
                     copies)


def extra_bound(partitioned, program: str) -> int:
  """A bound of the device bytes ``program`` may hold beyond ``jax.jit``'s
  program for ``partitioned``, read from the jaxpr (nothing compiled, so it
  holds in any context, a gradient taken outside included).

  What runs side by side may be live at once where ``jax.jit``'s program
  runs it one part after the other: each part of a loop group beyond its
  largest, and each stream call (``footprint_bound``; views of a value,
  which XLA makes without a buffer, are not counted). Its factors are
  fitted to XLA's own figures, which came out below it in every program
  measured, forward, training step and a gradient taken outside, with a
  margin (docs/xla.md; tests/test_memory.py checks the tightest on every
  jax): an estimate with room, not a proof."""
  if emits_inline(partitioned, program):
    return 0
  graph = partitioned.graph
  extra = 0
  grouped: set[int] = set()
  if program in FUSING_PROGRAMS:
    for group in graph.loops:
      sizes = [footprint_bound(partitioned, r, grouped=True) for r in group]
      extra += sum(sizes) - max(sizes)
      grouped.update(group)
  if program == "streams":
    in_place = partitioned.decisions.in_place
    extra += sum(footprint_bound(partitioned, r)
                 for r, stream in enumerate(graph.streams)
                 if stream != 0 and r not in grouped and r not in in_place)
  return extra


# A stream call's bound: what it reads and makes, this many times (the
# values, a gradient's cotangents of them, and the copies XLA makes of a
# call's operands). Twice was short of XLA's figure for a gradient taken
# outside four stream calls (jaxlib 0.12: 6.8 MiB beyond jax.jit's program
# against 5.3); three, once each call returned one tuple (the same at half
# width: 2.2 MiB against 2.0).
BOUND_FACTOR = 4
# A grouped loop's bound per byte of its stacked operands (the loop's copy
# of them, a gradient's stack of their cotangents, and what XLA adds around
# them): XLA's figure reached 3.5 times them for checkpointed scan towers
# under a gradient taken outside (jaxlib 0.11.2; 2.7 for plain scans).
STACKED_FACTOR = 4


def footprint_bound(partitioned, region: int, grouped: bool = False) -> int:
  """A bound of the bytes region ``region`` of ``partitioned`` may hold
  while it runs beside others, under a gradient too. A stream call:
  ``BOUND_FACTOR`` times what it reads and makes, a loop's step values
  counted per step and once more. A loop of a group (``grouped``), whose
  one loop keeps its state alive for the whole group: ``STACKED_FACTOR``
  times its stacked operands, twice its results and its step's values (a
  gradient's cotangents of them); what a gradient saves per step,
  ``jax.jit``'s program holds as well."""
  eqns = partitioned.region_equations(region)
  if grouped:
    (loop,) = eqns
    first_xs = sum(_compat.scan_counts(loop.params))
    stacked = sum(_bytes(v) for v in loop.invars[first_xs:])
    results = sum(_bytes(v) for v in loop.outvars)
    step = _made(loop.params["jaxpr"].jaxpr.eqns)
    return STACKED_FACTOR * stacked + 2 * (results + step)
  inputs = sum(_bytes(v) for v in partitioned.graph.inputs[region])
  return BOUND_FACTOR * (inputs + _made(eqns))


# Primitives whose results XLA makes without a buffer of their own (a view
# of their operand, folded into the fusion that reads it).
_VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "slice",
                    "dynamic_slice", "transpose", "broadcast_in_dim",
                    "convert_element_type", "copy"})


def _made(eqns, times: int = 1) -> int:
  """Bytes of the values ``eqns`` make (views of another value left out),
  each ``times``; inside a scan's body ``length + 1`` times as many."""
  total = 0
  for eqn in eqns:
    if eqn.primitive.name not in _VIEWS:
      total += times * sum(_bytes(v) for v in eqn.outvars)
    steps = (int(eqn.params["length"]) + 1 if eqn.primitive.name == "scan"
             else 1)
    for sub in sub_jaxprs(eqn):
      total += _made(getattr(sub, "jaxpr", sub).eqns, times * steps)
  return total


def _bytes(var) -> int:
  aval = getattr(var, "aval", None)
  shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  size = 1
  for n in shape:
    size *= int(n)
  return size * getattr(dtype, "itemsize", 0)
