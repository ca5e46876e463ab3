"""Stage 3 of the pipeline: regions, their dependencies, and the plan."""

from jaxstreams.partition.plan import (Dependency, PlannedEquation, Region,
                                       StreamPlan, make_plan)
from jaxstreams.partition.regions import RegionGraph, partition
from jaxstreams.partition.schedule import Schedule, estimate

__all__ = ["Dependency", "PlannedEquation", "Region", "RegionGraph",
           "Schedule", "StreamPlan", "estimate", "make_plan", "partition"]
