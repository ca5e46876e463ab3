"""Stage 2 of the pipeline: give every equation a stream."""

from jaxstreams.assign.cost import (DEFAULT_DEVICE, Cost, DeviceModel,
                                    equation_cost)
from jaxstreams.assign.placement import (Placement, StreamIdError,
                                         assign_streams, equation_name)
from jaxstreams.assign.rules import RulesFileError, StreamRules, load_rules
from jaxstreams.assign.spread import spread_assign

__all__ = ["Cost", "DEFAULT_DEVICE", "DeviceModel", "Placement",
           "RulesFileError", "StreamIdError", "StreamRules", "assign_streams",
           "equation_cost", "equation_name", "load_rules", "spread_assign"]
