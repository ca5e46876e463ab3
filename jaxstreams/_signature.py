"""One argument signature for every cache keyed by what a trace depends on.

A traced program depends on each leaf's abstract value: its shape, dtype,
weak type and sharding. Python scalars are weakly typed (``bf16_array * 1.0``
stays bfloat16, while ``bf16_array * np.float32(1.0)`` is float32); an array
on a mesh with explicit axes carries its sharding into the trace
(``float32[8@x]``), and what is computed from it is sharded too. ``serve`` and
``staged`` both key their traces by this; a key without one of these reuses a
trace made for another kind of argument: the wrong dtype, or the wrong
sharding.

The sharding is the one in the abstract value, the one a trace sees, not the
concrete placement: arrays on different devices, committed or not, trace the
same program, and ``jax.jit`` compiles for their placement itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class LeafSignature(NamedTuple):
  shape: tuple[int, ...]
  dtype: Any
  weak_type: bool
  sharding: Any     # the abstract value's sharding (hashable)

  def struct(self) -> jax.ShapeDtypeStruct:
    """A stand-in to trace with: ``jax.make_jaxpr(f)(sig.struct())`` traces
    ``f`` as it would be traced with the leaf itself."""
    return jax.ShapeDtypeStruct(self.shape, self.dtype,
                                weak_type=self.weak_type,
                                sharding=self.sharding)


def leaf_signature(leaf) -> LeafSignature:
  """The signature of one leaf, as ``jax.jit`` would see it. Raises TypeError
  for a leaf jax cannot take (and for a jax Tracer: the callers take concrete
  values; see ``traced_signature``)."""
  if isinstance(leaf, jax.core.Tracer):
    raise TypeError(
        "jaxstreams: an argument holds a traced value (a jax Tracer) where a "
        "concrete array is needed. Call this outside jax.jit / jax.grad / "
        "jax.vmap.")
  if isinstance(leaf, jax.Array):    # the common case, kept cheap
    return _of_aval(leaf.aval)
  return _of_aval(jax.typeof(leaf))


def signature(leaves) -> tuple[LeafSignature, ...]:
  """The signatures of ``leaves``, as one hashable tuple."""
  return tuple(leaf_signature(leaf) for leaf in leaves)


def traced_signature(leaves) -> tuple[LeafSignature, ...]:
  """``signature`` of tracers inside a trace: equal to the ``signature`` of
  the concrete leaves they stand for."""
  return tuple(_of_aval(jax.typeof(leaf)) for leaf in leaves)


def _of_aval(aval) -> LeafSignature:
  # tuple.__new__ skips NamedTuple's Python-level constructor: this runs for
  # every leaf of every served request. An aval's shape is a tuple already.
  return _new_tuple(LeafSignature, (aval.shape, aval.dtype, aval.weak_type,
                                    aval.sharding))


_new_tuple = tuple.__new__
