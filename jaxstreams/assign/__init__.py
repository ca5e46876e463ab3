"""Stage 2 of the pipeline: give every equation a stream."""

from jaxstreams.assign.placement import Placement, StreamIdError, assign_streams

__all__ = ["Placement", "StreamIdError", "assign_streams"]
