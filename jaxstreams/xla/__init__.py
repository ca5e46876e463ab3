"""What XLA:GPU will run: compile for a GPU without one (``gpu_target``),
read the compiled schedule of the regions jaxstreams emits
(``xla_schedule``), the CUDA graphs XLA launches (``xla_graphs``) and the
step's estimated time (``XlaGraphs.estimate``, ``step_time``)."""

from jaxstreams.xla.graph import (CudaGraph, GraphLogError, Kernel,
                                  OutsideGraph, XlaGraphs, xla_graphs,
                                  xla_graphs_of)
from jaxstreams.xla.schedule import (AsyncRegion, Collective, HloParseError,
                                     PairCheck, XlaSchedule, xla_schedule)
from jaxstreams.xla.step_time import StepEstimate
from jaxstreams.xla.target import (BUILTIN_TARGETS, GpuTarget, GpuTargetError,
                                   gpu_target, install_command)

__all__ = ["AsyncRegion", "BUILTIN_TARGETS", "Collective", "CudaGraph",
           "GpuTarget", "GpuTargetError", "GraphLogError", "HloParseError",
           "Kernel", "OutsideGraph", "PairCheck", "StepEstimate", "XlaGraphs",
           "XlaSchedule", "gpu_target", "install_command", "xla_graphs",
           "xla_graphs_of", "xla_schedule"]
