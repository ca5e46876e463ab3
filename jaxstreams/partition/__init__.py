"""Stage 3 of the pipeline: regions, their dependencies, and the plan.

``PartitionedProgram`` is what lowering emits; ``StreamPlan``, made from it
by ``report``, is what users read.
"""

from jaxstreams.partition.partitioned import PartitionedProgram
from jaxstreams.partition.plan import (Dependency, PlannedEquation, Region,
                                       StreamPlan, report)
from jaxstreams.partition.regions import RegionGraph, partition
from jaxstreams.partition.schedule import Schedule, estimate

__all__ = ["Dependency", "PartitionedProgram", "PlannedEquation", "Region",
           "RegionGraph", "Schedule", "StreamPlan", "estimate", "partition",
           "report"]
