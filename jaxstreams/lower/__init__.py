"""Stage 4 of the pipeline: emit each region where its plan puts it, in the
way a GPU runs it best (``gpu``: the ways and the static rule;
``choose``: which way a function's calls run, timed in its first calls)."""

from jaxstreams.lower.emit import emit, region_function

__all__ = ["emit", "region_function"]
