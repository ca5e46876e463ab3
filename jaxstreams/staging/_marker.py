"""``stage(x)``, the mark of a stage boundary, and how a trace shows it.

Inside a trace ``stage(x)`` leaves one identity equation per leaf:
``checkpoint_name`` with a reserved name, an identity JAX differentiates,
batches and lowers already, and XLA removes. Outside a staged step (eagerly,
under ``jax.jit`` or a plain ``jaxstreams.jit`` call) it is therefore the
identity, so the same step function runs staged and unstaged, and the
unstaged loop is the reference the staged one is checked against. The split
analysis finds these equations with ``is_marker``.
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
  """Marks a stage boundary: what computes ``x`` from the step's data
  argument is the producer, which ``jaxstreams.staged`` runs ahead on later
  batches. ``x`` is a pytree of arrays; returns it unchanged.

  Outside a traced function this returns ``x`` itself, and under ``jax.jit``
  or an unstaged ``jaxstreams.jit`` call it is an identity, so a step that
  calls ``stage`` also runs as an ordinary step.
  """
  leaves = tree_util.tree_leaves(x)
  if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
    return x
  return tree_util.tree_map(lambda leaf: checkpoint_name(leaf, STAGE_NAME), x)


def is_marker(eqn) -> bool:
  """Whether ``eqn`` is one of ``stage()``'s identity equations."""
  return eqn.primitive.name == "name" and eqn.params.get("name") == STAGE_NAME


def has_nested_marker(eqn) -> bool:
  """Whether a ``stage()`` marker sits inside ``eqn`` (a nested jit, a loop
  body, a branch), where the split cannot use it."""
  return any(any_equation(sub.eqns, is_marker)
             for sub in _compat.sub_jaxprs(eqn))
