"""Stage 1 of the pipeline: user code tags equations with streams
(``stream``, ``colocate_with``) and marks ``staged``'s stage boundaries
(``boundary.stage``)."""

from jaxstreams.tag.read import ExposedProgram, Tag, effective_tag, expose_tags
from jaxstreams.tag.scopes import colocate_with, stream

__all__ = ["ExposedProgram", "Tag", "colocate_with", "effective_tag",
           "expose_tags", "stream"]
