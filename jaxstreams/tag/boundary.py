"""``stage(x)``: how user code marks a stage boundary for ``staged``.

Like a stream tag, the mark must survive JAX's transformations: it is one
``checkpoint_name`` identity per leaf, which JAX differentiates, batches
and lowers, and XLA removes. ``partition.stages`` reads the marks.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import tree_util
from jax.ad_checkpoint import checkpoint_name

STAGE_NAME = "jaxstreams_stage"


def stage(x: Any) -> Any:
  """Marks a stage boundary: what computes ``x`` (a pytree of arrays) from
  the step's data argument is the producer, which ``jaxstreams.staged``
  runs ahead on later batches. Returns ``x`` unchanged; outside a staged
  step it is an identity."""
  leaves = tree_util.tree_leaves(x)
  if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
    return x
  return tree_util.tree_map(lambda leaf: checkpoint_name(leaf, STAGE_NAME), x)


def is_marker(eqn) -> bool:
  """Whether ``eqn`` is one of ``stage()``'s identity equations."""
  return eqn.primitive.name == "name" and eqn.params.get("name") == STAGE_NAME
