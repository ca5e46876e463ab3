"""One argument signature for every cache keyed by what a trace depends on.

A traced program depends on each leaf's shape, dtype and weak type (Python
scalars are weakly typed: ``bf16_array * 1.0`` stays bfloat16, while
``bf16_array * np.float32(1.0)`` is float32). ``serve`` and ``staged`` both
key their traces by this; a key without the weak type reuses a trace made
for the other kind of scalar and returns the wrong dtype.
"""

from __future__ import annotations

import jax


def leaf_signature(leaf) -> tuple:
  """``(shape, dtype, weak_type)`` of one leaf, as ``jax.jit`` would see it.
  Raises TypeError for a leaf jax cannot take (and for a jax Tracer: the
  callers take concrete values)."""
  if isinstance(leaf, jax.core.Tracer):
    raise TypeError(
        "jaxstreams: an argument holds a traced value (a jax Tracer) where a "
        "concrete array is needed. Call this outside jax.jit / jax.grad / "
        "jax.vmap.")
  if isinstance(leaf, jax.Array):        # the common case, kept cheap
    return leaf.shape, leaf.dtype, leaf.weak_type
  aval = jax.typeof(leaf)
  return tuple(aval.shape), aval.dtype, bool(aval.weak_type)


def signature(leaves) -> tuple:
  """The signatures of ``leaves``, as one hashable tuple."""
  return tuple(leaf_signature(leaf) for leaf in leaves)
