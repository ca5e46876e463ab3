"""``PartitionedProgram``: the pipeline's result for one traced function,
what lowering emits.

It holds the exposed program, each equation's placement and cost, the region
graph and the estimated schedule: jaxpr variables and equations, nothing
printable. The user's report, ``StreamPlan`` (``partition/plan.py``), is built
from it on request, so tracing a ``jaxstreams.jit`` function never pays for
names and source lines, and lowering never reads the report.
"""

from __future__ import annotations

import dataclasses

from jaxstreams.assign import Cost, Placement
from jaxstreams.partition.regions import RegionGraph
from jaxstreams.partition.schedule import Schedule
from jaxstreams.tag.read import ExposedProgram


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

  @property
  def has_calls(self) -> bool:
    """Whether any region, here or in a body, is off the main stream."""
    return (any(stream != 0 for stream in self.graph.streams)
            or any(body.has_calls for body in self.bodies.values()))

  def region_equations(self, index: int) -> list:
    """The equations of region ``index``, in program order."""
    eqns = self.program.jaxpr.eqns
    return [eqns[i] for i in self.graph.members[index]]
