"""Stage 4 of the pipeline: emit each region where its plan puts it."""

from jaxstreams.lower.emit import emit, region_function

__all__ = ["emit", "region_function"]
