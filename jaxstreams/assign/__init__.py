"""Stage 2 of the pipeline: give every equation a stream."""

from jaxstreams.assign.auto import auto_assign
from jaxstreams.assign.cost import (DEFAULT_DEVICE, Cost, DeviceModel,
                                    equation_cost)
from jaxstreams.assign.placement import (Placement, StreamIdError,
                                         assign_streams, equation_name)
from jaxstreams.assign.rules import RulesFileError, StreamRules, load_rules

__all__ = ["Cost", "DEFAULT_DEVICE", "DeviceModel", "Placement",
           "RulesFileError", "StreamIdError", "StreamRules", "assign_streams",
           "auto_assign", "equation_cost", "equation_name", "load_rules"]
