"""Stage 3 of the pipeline: regions, their dependencies, and the plan.

``PartitionedProgram`` is what lowering emits; ``StreamPlan``, made from it
by ``report``, is what users read. ``stages`` cuts a step into ``staged``'s
producer stages and consumer (its ``StagedPlan``). ``cut`` (what a part of
a jaxpr reads, makes and runs) serves partition, staging and serving alike.
"""

from jaxstreams.partition.cut import Part, cut, part_function, part_jaxpr
from jaxstreams.partition.partitioned import PartitionedProgram
from jaxstreams.partition.plan import (Dependency, LoopGroup, PlannedEquation,
                                       Region, StreamPlan, report)
from jaxstreams.partition.regions import RegionGraph, partition
from jaxstreams.partition.schedule import Schedule, estimate

__all__ = ["Dependency", "LoopGroup", "Part", "PartitionedProgram",
           "PlannedEquation", "Region", "RegionGraph", "Schedule", "StreamPlan",
           "cut", "estimate", "part_function", "part_jaxpr", "partition",
           "report"]
