"""What a ``jaxstreams.jit`` function calls, as its choice of way goes: its
first top-level call settles the choice (``FirstCall``); then top-level and
nested calls go each to their own ``jax.jit`` function (``Switch``), the
chosen way's watched for signatures it has not seen (``Watch``), or are
looked up by signature while a choice is open (``BySignature``). Each is a
small callable the function points to, so that a settled function's calls
reach ``jax.jit``'s C++ fast path with one Python call between.
"""

from __future__ import annotations

from jaxstreams import _compat
from jaxstreams.lower import gpu


class _Held:
  """A callable that reaches its ``StreamJit`` through ``ref``, a weak
  reference: the function holds it."""

  __slots__ = ("ref",)

  def __init__(self, ref):
    self.ref = ref


class FirstCall(_Held):
  """What a ``StreamJit`` calls until its first top-level call settled the
  ``jax.jit`` functions."""

  __slots__ = ()

  @_compat.api_boundary
  def __call__(self, *args, **kwargs):
    me = self.ref()
    if me._streams is None:
      return me._by_option()(*args, **kwargs)
    if not _compat.at_top_level():
      return me._nested_jit_for(args, kwargs)(*args, **kwargs)
    return me._chooser.settle(args, kwargs)(*args, **kwargs)


class Nested(_Held):
  """Calls traced inside another jit (or under ``jax.grad`` / ``jax.vmap``):
  to the nested way's ``jax.jit`` function, or to ``jax.jit``'s program
  where the nested way emits that for the call's plan, so the call shares
  its trace with top-level calls (``StreamJit._nested_jit_for``)."""

  __slots__ = ()

  @_compat.api_boundary
  def __call__(self, *args, **kwargs):
    return self.ref()._nested_jit_for(args, kwargs)(*args, **kwargs)


class Switch:
  """Top-level calls to ``top``, calls traced inside another jit (or under
  ``jax.grad`` / ``jax.vmap``) to ``nested``: jax accepts compiler options
  only at top level."""

  __slots__ = ("top", "nested")

  def __init__(self, top, nested):
    self.top, self.nested = top, nested

  @_compat.api_boundary
  def __call__(self, *args, **kwargs):
    if _compat.at_top_level():
      return self.top(*args, **kwargs)
    return self.nested(*args, **kwargs)


class Watch(Switch):
  """A ``Switch`` whose top-level ``jax.jit`` function is the way every
  signature so far chose: a call whose signature that function had not seen
  (an entry more in its call cache, a check that costs a C++ call) is
  reported to the chooser (``choice.Chooser``), which then times the ways
  for it."""

  __slots__ = ("chooser", "way", "seen")

  def __init__(self, top, nested, chooser, way: gpu.Way):
    super().__init__(top, nested)
    self.chooser, self.way = chooser, way
    self.seen = top._cache_size()

  @_compat.api_boundary
  def __call__(self, *args, **kwargs):
    if not _compat.at_top_level():
      return self.nested(*args, **kwargs)
    out = self.top(*args, **kwargs)
    seen = self.top._cache_size()
    if seen != self.seen:
      grew, self.seen = seen > self.seen, seen
      if grew:
        self.chooser.saw(args, kwargs, self.way)
    return out


class BySignature(_Held):
  """Top-level calls looked up by signature (while a choice is open, or
  where signatures chose different ways); nested calls to the nested way."""

  __slots__ = ()

  @_compat.api_boundary
  def __call__(self, *args, **kwargs):
    me = self.ref()
    if not _compat.at_top_level():
      return me._nested_jit_for(args, kwargs)(*args, **kwargs)
    return me._chooser.call(args, kwargs)
