"""``stage(x)``, the mark of a stage boundary: one ``checkpoint_name``
identity per leaf with a reserved name, which JAX differentiates, batches
and lowers, and XLA removes. Outside a staged step it is the identity, so
the same step runs staged and unstaged.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import tree_util
from jax.ad_checkpoint import checkpoint_name

from jaxstreams import _compat
from jaxstreams.tag.read import any_equation

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


def has_nested_marker(eqn) -> bool:
  """Whether a ``stage()`` marker sits inside ``eqn``'s sub-jaxprs."""
  return any(any_equation(sub.eqns, is_marker)
             for sub in _compat.sub_jaxprs(eqn))
