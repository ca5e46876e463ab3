"""``stream()`` and ``colocate_with()``: how user code tags equations.

A tag is a scope on JAX's name stack (``jax.named_scope``), e.g.
``jaxstreams_stream_1``. Name stacks are the one piece of equation metadata
that JAX carries through every transformation: ``jax.vmap`` and ``jax.jvp``
keep them, and ``jax.grad`` gives each backward-pass equation the name stack
of the forward equation it was transposed from, wrapped in a ``transpose``
transform. That is what lets gradients follow their forward computation onto
the same stream, and what ``include_grad=False`` looks for to leave them off.

``colocate_with(x)`` cannot name a stream yet (the stream of ``x``'s producer
is only known once the plan is made), so it leaves an anchor: an identity
equation on ``x`` carrying a token, and a scope naming that token. The
assignment pass resolves the token to the stream of whatever produced ``x``
and drops the anchor.
"""

from __future__ import annotations

import itertools
import re
import threading
from typing import Any

import jax
import jax.extend.core as jcore
from jax.interpreters import ad, batching, mlir

from jaxstreams import _checks

__all__ = ["stream", "colocate_with"]

_STREAM_SCOPE = "jaxstreams_stream_{id}{nograd}"
_COLOCATE_SCOPE = "jaxstreams_colocate_{token}"
_SCOPE_RE = re.compile(r"^jaxstreams_(stream|colocate)_(\d+)(_nograd)?$")


def parse_scope(name: str) -> tuple[str, int, bool] | None:
  """("stream"|"colocate", id or token, include_grad) for a jaxstreams scope."""
  match = _SCOPE_RE.match(name)
  if match is None:
    return None
  kind, number, nograd = match.groups()
  return kind, int(number), nograd is None


def _stream_id(stream_id: Any) -> int:
  return _checks.integer(stream_id, name="stream_id", minimum=0,
                         context="jaxstreams.stream(stream_id)",
                         meaning=" (0 is the main stream)")


class stream:
  """Place the work traced inside this block on stream group ``stream_id``.

  Used inside a function given to ``jaxstreams.jit``::

      @jaxstreams.jit(streams=2)
      def step(x, w):
        with jaxstreams.stream(1):
          a = tower(x, w)      # stream 1
        b = other(x)           # stream 0 (or assigned by jaxstreams)
        return a + b

  Stream 0 is the main stream; ids must be below the function's ``streams``
  (checked when the plan is made, with the line of the offending block).
  Blocks nest; the innermost wins. With ``include_grad=True`` (the default)
  the backward-pass equations that ``jax.grad`` derives from equations in the
  block go to the same stream; with ``False`` they are placed as if untagged.

  Outside any trace, or in a function traced by plain ``jax.jit``, the block
  only adds a name scope and changes nothing.
  """

  def __init__(self, stream_id: int, *, include_grad: bool = True):
    if not isinstance(include_grad, bool):
      raise TypeError(f"jaxstreams.stream: include_grad must be a bool, got "
                      f"{include_grad!r}")
    self.stream_id = _stream_id(stream_id)
    self.include_grad = include_grad
    self._scopes: list[Any] = []

  @property
  def scope_name(self) -> str:
    return _STREAM_SCOPE.format(id=self.stream_id,
                                nograd="" if self.include_grad else "_nograd")

  def __enter__(self) -> "stream":
    scope = jax.named_scope(self.scope_name)
    scope.__enter__()
    self._scopes.append(scope)
    return self

  def __exit__(self, *exc_info) -> None:
    self._scopes.pop().__exit__(*exc_info)

  def __repr__(self) -> str:
    grad = "" if self.include_grad else ", include_grad=False"
    return f"jaxstreams.stream({self.stream_id}{grad})"


# ---------------------------------------------------------------------------
# colocate_with

colocate_anchor_p = jcore.Primitive("jaxstreams_colocate_anchor")
colocate_anchor_p.def_impl(lambda x, *, token: x)
colocate_anchor_p.def_abstract_eval(lambda aval, *, token: aval)
# The anchor's output is never used; the rules only let it pass through any
# transformation that might be applied inside the tagged function.
mlir.register_lowering(colocate_anchor_p, lambda ctx, x, *, token: [x])
batching.defvectorized(colocate_anchor_p)
ad.primitive_jvps[colocate_anchor_p] = (
    lambda primals, tangents, *, token:
    (colocate_anchor_p.bind(primals[0], token=token), tangents[0]))

_tokens = itertools.count(1)
_tokens_lock = threading.Lock()


class colocate_with:
  """Place the work traced inside this block on the stream that produced ``x``.

  ``x`` must be a value traced inside the ``jaxstreams.jit`` function (an
  intermediate result or an argument; arguments live on the main stream).
  """

  def __init__(self, x: Any):
    if not isinstance(x, jax.core.Tracer):
      if any(isinstance(leaf, jax.core.Tracer)
             for leaf in jax.tree_util.tree_leaves(x)):
        raise TypeError(
            "jaxstreams.colocate_with(x): x must be one traced array, got a "
            f"{type(x).__name__} of them; its leaves may come from different "
            "streams, so pass the one leaf whose stream the work should "
            "follow, e.g. colocate_with(jax.tree_util.tree_leaves(x)[0])")
      raise TypeError(
          "jaxstreams.colocate_with(x): x must be a value traced inside a "
          "jaxstreams.jit function (a jax tracer), got "
          f"{type(x).__module__}.{type(x).__name__}. Use it on an intermediate "
          "result of the traced function, not on a constant or a concrete "
          "array.")
    with _tokens_lock:
      self.token = next(_tokens)
    colocate_anchor_p.bind(x, token=self.token)
    self._scopes: list[Any] = []

  def __enter__(self) -> "colocate_with":
    scope = jax.named_scope(_COLOCATE_SCOPE.format(token=self.token))
    scope.__enter__()
    self._scopes.append(scope)
    return self

  def __exit__(self, *exc_info) -> None:
    self._scopes.pop().__exit__(*exc_info)
