"""Stage 1 of the pipeline: user code tags equations with streams."""

from jaxstreams.tag.read import ExposedProgram, Tag, effective_tag, expose_tags
from jaxstreams.tag.scopes import colocate_with, stream

__all__ = ["ExposedProgram", "Tag", "colocate_with", "effective_tag",
           "expose_tags", "stream"]
