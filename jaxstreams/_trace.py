"""``trace(fun, args, kwargs)``: a function and its arguments to a jaxpr.

``jaxstreams.jit`` traces the user's function inside ``jax.jit``'s trace to
plan it, ``staged`` traces a step once per batch signature to split it, and
``serve`` traces the served function once per request signature. Each needs
the same three things, and gets them here: the closed jaxpr, the arguments
in the order of the jaxpr's inputs, and the tree of the outputs (to rebuild
the results).

The user's function itself is traced, not a wrapper that flattens its
arguments, so that jax's tracing errors name that function, its file and
line, and the argument (``x``, ``params['w']``) as ``jax.jit``'s do.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from jax import tree_util

from jaxstreams import _compat


class Traced(NamedTuple):
  closed: Any       # jax.extend.core.ClosedJaxpr
  flat_args: list   # the traced leaves, in the order of closed.jaxpr.invars
  out_tree: Any     # the outputs' PyTreeDef


def trace(fun: Callable, args: tuple, kwargs: dict, *,
          traced: Callable[[Any], bool] | None = None) -> Traced:
  """``fun(*args, **kwargs)`` traced to a jaxpr.

  Every leaf is an input of the jaxpr, unless ``traced`` is given: then
  only the leaves it accepts are, and an argument with leaves of which it
  accepts none is static (its value baked into the jaxpr). ``jaxstreams.jit``
  passes ``traced`` inside ``jax.jit``'s trace, where static arguments come
  as plain values and the others as tracers.
  """
  static_argnums: tuple[int, ...] = ()
  static_argnames: tuple[str, ...] = ()
  if traced is not None:
    def is_static(tree) -> bool:
      leaves = tree_util.tree_leaves(tree)
      return bool(leaves) and not any(traced(leaf) for leaf in leaves)
    static_argnums = tuple(i for i, arg in enumerate(args) if is_static(arg))
    static_argnames = tuple(k for k, v in kwargs.items() if is_static(v))
  return Traced(*_compat.trace_to_jaxpr(fun, args, kwargs, static_argnums,
                                        static_argnames))
