"""What XLA:GPU will run: compile for a GPU without one (``gpu_target``) and
read the compiled schedule of the regions jaxstreams emits (``xla_schedule``)."""

from jaxstreams.xla.schedule import (AsyncRegion, HloParseError, PairCheck,
                                     XlaSchedule, xla_schedule)
from jaxstreams.xla.target import (BUILTIN_TARGETS, GpuTarget, GpuTargetError,
                                   gpu_target, install_command)

__all__ = ["AsyncRegion", "BUILTIN_TARGETS", "GpuTarget", "GpuTargetError",
           "HloParseError", "PairCheck", "XlaSchedule", "gpu_target",
           "install_command", "xla_schedule"]
