"""``PartitionedProgram``: the pipeline's result for one traced function,
what lowering emits.

It holds the exposed program, each equation's placement and cost, the region
graph and the estimated schedule: jaxpr variables and equations, nothing
printable. The user's report, ``StreamPlan`` (``partition/plan.py``), is built
from it on request, so tracing a ``jaxstreams.jit`` function never pays for
names and source lines, and lowering never reads the report.

It also carries what lowering decided before emitting anything
(``Decisions``, made by ``jaxstreams.lower.decide``): which regions the
installed XLA cannot compile as stream calls, how each group of loops
runs as one, and the functions each region and loop body is cut into.
Emission turns them into the program and decides nothing; the report
shows them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxstreams.assign import Cost, Placement
from jaxstreams.partition.loops import Phase
from jaxstreams.partition.regions import RegionGraph
from jaxstreams.partition.schedule import Schedule
from jaxstreams.tag.read import ExposedProgram


@dataclasses.dataclass(frozen=True, eq=False)
class BodyTail:
  """A loop body cut where part of it runs after its stream call, on the
  main stream (``LoopBody.tail``). ``head``: what the call runs, a closed
  jaxpr of (body constants, loop constants, carry, slices) returning the
  carry, the body's results it makes (``from_tail`` False) and what the
  tail reads from it (``num_needed`` values, the incoming carry among
  them); ``tail``: a closed jaxpr of (body and loop constants, slices,
  those values) returning the rest of the results (``from_tail`` True), in
  the body's order. ``num_fixed``: the body's and loop's constants;
  ``num_carry``: the carry; ``num_head_ys``: the results ``head`` makes."""
  head: Any = dataclasses.field(repr=False)
  tail: Any = dataclasses.field(repr=False)
  from_tail: tuple[bool, ...]
  num_fixed: int
  num_carry: int
  num_head_ys: int
  num_needed: int


@dataclasses.dataclass(frozen=True)
class LoopBody:
  """How the body of one scan of a loop group runs in the group's one loop,
  on the installed jaxlib. ``body``: the scan's body (a closed jaxpr: body
  constants, loop constants, carry, slices in; carry, results out), and
  ``eqns`` its equations as emitted (``jax.checkpoint``'s barriers off,
  ``limits.without_cse_barriers``); ``num_consts``, ``num_carry``: its
  loop constants and carry. ``in_place``: why it runs in place (on the
  main stream, in the loop's step) instead of as a stream call, or None
  (the main stream's body runs in place anyway); ``tail``: the positions
  of its top-level equations that run after its call, on the main stream,
  so that the rest is a call XLA compiles (empty: none); ``why``: why the
  installed XLA cannot compile the body whole as a call, or None.

  The functions it is emitted as, cut before emission: ``function``, the
  body as emitted (a closed jaxpr of body constants, loop constants,
  carry, slices); ``split``, the same cut at its tail (``BodyTail``,
  where ``tail`` is not empty); ``scan``, the scan equation itself as a
  closed jaxpr of its operands that are not literals, in operand order
  (what XLA:CPU runs). ``packed_as``: the dtype its call returns its
  results in, one buffer, where they are several (jaxlib 0.10 runs a call
  with several results to its done before the next call starts;
  ``lower/packing.py``), or None."""
  region: int
  body: Any = dataclasses.field(compare=False, repr=False)
  eqns: tuple = dataclasses.field(compare=False, repr=False)
  num_consts: int
  num_carry: int
  in_place: str | None = None
  tail: tuple[int, ...] = ()
  why: str | None = None
  function: Any = dataclasses.field(default=None, compare=False, repr=False)
  split: BodyTail | None = dataclasses.field(default=None, compare=False,
                                             repr=False)
  scan: Any = dataclasses.field(default=None, compare=False, repr=False)
  packed_as: Any = None


@dataclasses.dataclass(frozen=True)
class LoopPlan:
  """A group of scans (``RegionGraph.loops``) run as one loop: its regions,
  direction, each scan's layers, the loops it runs as (``partition.loops.
  layout``, positions in ``regions``) and each body's ``LoopBody``."""
  regions: tuple[int, ...]
  reverse: bool
  lengths: tuple[int, ...]
  phases: tuple[Phase, ...]
  bodies: tuple[LoopBody, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Decisions:
  """What lowering decided for a program before emitting it (``jaxstreams.
  lower.decide``), for the installed jaxlib. ``in_place``: the off-main
  regions that XLA cannot compile as stream calls, and why (grouped scans
  among them run as one loop instead where the way fuses loops); ``loops``:
  how each group of ``graph.loops`` runs as one loop, in that order.

  And the functions the program is cut into for emission: ``regions``,
  each region as a closed jaxpr of its inputs returning its outputs;
  ``equations``, each main-stream equation that emission may bind alone
  (under sequence points, or in a region with a keyed collective or a
  planned ``shard_map`` body) as a closed jaxpr of the values it reads
  (each once, first read first). ``xla_streams``: the XLA:GPU compute stream of
  each region's call (0: the main stream). ``bodies_out_of_graphs``:
  whether a stream call in a loop can be kept out of XLA's CUDA graphs (the
  runtime's library, whose ``delay`` does that, is there).

  Where regions are stream calls (``jaxstreams.lower.order``): ``unread``,
  the regions left out (nothing reads them, and they have no effects);
  ``combiner_keys``, by main-stream collective that waits for a call, the
  key that keeps XLA from merging it with collectives waiting for others;
  ``collective_packings``, by call such a collective waits for, the
  ``Packing`` of its results into one buffer (the XLA that schedules
  stream calls itself)."""
  in_place: dict[int, str] = dataclasses.field(default_factory=dict)
  loops: tuple[LoopPlan, ...] = ()
  regions: tuple[Any, ...] = ()
  equations: dict[int, Any] = dataclasses.field(default_factory=dict)
  xla_streams: tuple[int, ...] = ()
  bodies_out_of_graphs: bool = False
  unread: frozenset[int] = frozenset()
  combiner_keys: dict[int, str] = dataclasses.field(default_factory=dict)
  collective_packings: dict[int, Any] = dataclasses.field(
      default_factory=dict)

  def bodies_in_place(self) -> tuple[dict[int, str], dict[int, str]]:
    """The grouped bodies that run in place, and why, by region; and those
    that run in part after their call, and why."""
    bodies = [b for group in self.loops for b in group.bodies]
    return ({b.region: b.in_place for b in bodies if b.in_place},
            {b.region: b.why for b in bodies if b.tail})


@dataclasses.dataclass(frozen=True, eq=False)
class PartitionedProgram:
  """A traced program cut into regions, one stream each, in emission order.

  ``placements`` and ``costs`` follow ``program.jaxpr.eqns``; ``graph`` numbers
  the regions. ``reduce_stream_wait`` is the option the plan was made with:
  whether the report lists only the cross-stream dependencies left after
  transitive reduction."""
  function_name: str
  streams: int
  program: ExposedProgram
  placements: tuple[Placement, ...]
  costs: tuple[Cost, ...]
  graph: RegionGraph
  schedule: Schedule
  summary: str = ""          # what spreading decided, if on
  reduce_stream_wait: bool = True
  # Per ``shard_map`` equation placed "inside" (by its index): the plan of
  # its per-device body, emitted in the shard_map's place when regions are
  # calls.
  bodies: dict[int, "PartitionedProgram"] = dataclasses.field(
      default_factory=dict)
  # What lowering decided before emission (``jaxstreams.lower.decide``).
  decisions: Decisions = Decisions()

  @property
  def has_calls(self) -> bool:
    """Whether any region, here or in a body, is off the main stream."""
    return (any(stream != 0 for stream in self.graph.streams)
            or any(body.has_calls for body in self.bodies.values()))

  def region_equations(self, index: int) -> list:
    """The equations of region ``index``, in program order."""
    eqns = self.program.jaxpr.eqns
    return [eqns[i] for i in self.graph.members[index]]
