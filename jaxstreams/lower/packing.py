"""Several outputs of a region call in one buffer, and back, exactly.

A stream call returns its outputs packed where XLA would otherwise treat
each element of its result tuple apart: the sequence points pin a
single-output call-done, and the XLA that schedules stream calls itself
counts each tuple element as a window of its own (``lower/order.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxstreams import _compat
from jaxstreams.lower.calls import order_barrier


class Packing:
  """Several outputs in one 1-D buffer of one dtype and back, exactly. The
  floating outputs must share one dtype, which carries everything; booleans
  and integers that dtype holds exactly are converted, wider integers are
  bitcast (integers carry no gradient). Float packing is concatenation and
  slicing, so gradients flow through it; on CPU, where regions are inlined,
  XLA folds it away."""

  def __init__(self, outputs, carrier):
    self.carrier = np.dtype(carrier)
    self.slots = {}
    offset = 0
    for var in outputs:
      size = (int(np.prod(var.aval.shape, dtype=np.int64))
              * self._width(var.aval.dtype))
      self.slots[var] = (offset, size)
      offset += size

  @classmethod
  def of(cls, outputs) -> "Packing | None":
    if len({_compat.varying_axes(v.aval) for v in outputs}) > 1:
      # In a shard_map body, values that vary over different mesh axes: one
      # buffer would vary over them all, and no slice of it could be the
      # same on every device again.
      return None
    dtypes = [np.dtype(v.aval.dtype) for v in outputs]
    floats = {d for d in dtypes if jnp.issubdtype(d, jnp.floating)}
    if len(floats) > 1 or any(jnp.issubdtype(d, jnp.complexfloating)
                              for d in dtypes):
      return None
    carrier = floats.pop() if floats else np.dtype(np.uint8)
    for d in dtypes:
      if d != carrier and cls._how(d, carrier) is None:
        return None
    return cls(outputs, carrier)

  @staticmethod
  def _how(dtype, carrier) -> str | None:
    if dtype == np.bool_:
      return "convert"
    if not jnp.issubdtype(dtype, jnp.integer):
      return None
    if dtype.itemsize % carrier.itemsize == 0:
      return "bitcast"
    if (jnp.issubdtype(carrier, jnp.floating)
        and np.iinfo(dtype).bits <= jnp.finfo(carrier).nmant + 1):
      return "convert"
    return None

  def _width(self, dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype != self.carrier and self._how(dtype, self.carrier) == "bitcast":
      return dtype.itemsize // self.carrier.itemsize
    return 1

  def pack(self, values):
    parts = []
    for value in values:
      dtype = np.dtype(value.dtype)
      if dtype != self.carrier:
        if self._how(dtype, self.carrier) == "bitcast":
          value = jax.lax.bitcast_convert_type(value, self.carrier)
        else:
          value = value.astype(self.carrier)
      parts.append(value.reshape(-1))
    return jnp.concatenate(parts)

  def unpack(self, buffer, var):
    offset, size = self.slots[var]
    piece = buffer[offset:offset + size]
    aval = var.aval
    dtype = np.dtype(aval.dtype)
    if dtype == self.carrier:
      return piece.reshape(aval.shape)
    if self._how(dtype, self.carrier) == "bitcast":
      width = self._width(dtype)
      piece = (piece.reshape(*aval.shape, width) if width > 1
               else piece.reshape(aval.shape))
      value = jax.lax.bitcast_convert_type(piece, dtype)
    else:
      value = piece.reshape(aval.shape).astype(dtype)
    # Materialized before use: XLA 0.10 fails to compile some fusions of this
    # conversion into a dot ("Couldn't find output tile sizes").
    return order_barrier([value])[0]
