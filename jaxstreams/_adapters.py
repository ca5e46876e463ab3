"""``jaxstreams.jit`` for libraries whose own jit takes modules.

``flax.nnx`` users write ``@nnx.jit def step(model, optimizer, batch)``:
modules go in as arguments and the step updates them in place. Equinox
users write ``@eqx.filter_jit def step(model, x)``: arguments and results
are pytrees that mix arrays with functions, ints and the like. ``jax.jit``
(and so ``jaxstreams.jit``) takes neither as it is. ``nnx_jit`` and
``filter_jit`` are those two decorators on top of ``jaxstreams.jit``: they
split the arguments into arrays and a hashable rest (``nnx.split``,
``eqx.partition``), give the arrays to a ``jaxstreams.jit`` function of
them with the rest static, and put the results back together
(``nnx.update`` of the modules given, ``eqx.combine`` of the results).
That is the user's own one-liner with ``nnx.split`` / ``eqx.partition``
and ``jax.jit``, written once.

flax and equinox are imported when a decorated function is made, never by
``import jaxstreams``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from jaxstreams import _compat, _jit

# The keywords of jax.jit that name argument positions: they would point at
# the split function's (state, static) arguments, not the user's.
_POSITIONAL = ("static_argnums", "static_argnames", "donate_argnums",
               "donate_argnames", "in_shardings")


class SplitJit:
  """A function whose arguments are split into arrays and a static rest,
  run by the ``jaxstreams.jit`` function ``pure``
  (``pure(arrays, static)``). ``split(*args, **kwargs)`` gives ``pure``'s
  arguments; ``plan``, ``lower`` and ``trace`` take the user's."""

  def __init__(self, fun: Callable, pure: _jit.StreamJit,
               split: Callable, finish: Callable):
    functools.update_wrapper(self, fun)
    self.pure = pure
    self.split = split
    self._finish = finish

  def __call__(self, *args, **kwargs):
    arrays, static = self.split(*args, **kwargs)
    return self._finish(args, kwargs, arrays, static,
                        self.pure(arrays, static))

  def plan(self, *args, **kwargs):
    """The ``StreamPlan`` of a call with these arguments."""
    return self.pure.plan(*self.split(*args, **kwargs))

  def lower(self, *args, **kwargs):
    return self.pure.lower(*self.split(*args, **kwargs))

  def trace(self, *args, **kwargs):
    return self.pure.trace(*self.split(*args, **kwargs))


def _check_keywords(name: str, jit_kwargs: dict) -> None:
  given = sorted(k for k in jit_kwargs if k in _POSITIONAL)
  if given:
    raise TypeError(
        f"jaxstreams.{name} does not take {', '.join(given)}: it splits the "
        f"arguments itself (arrays traced, everything else static, as "
        f"{'nnx.jit' if name == 'nnx_jit' else 'eqx.filter_jit'} does); "
        f"use jaxstreams.jit on a function of arrays to name positions")


def _decorator(make: Callable, name: str, fun, streams, spread, gpu_lowering,
               jit_kwargs):
  _check_keywords(name, jit_kwargs)
  options = dict(streams=streams, spread=spread, gpu_lowering=gpu_lowering,
                 **jit_kwargs)
  if fun is None:
    return lambda f: make(f, options)
  return make(fun, options)


# ---------------------------------------------------------------------------
# flax.nnx

def nnx_jit(fun: Callable | None = None, *, streams: int | None = None,
            spread: bool | None = None, gpu_lowering: str | None = None,
            **jit_kwargs: Any):
  """``nnx.jit`` on ``jaxstreams.jit``: modules (and any graph of them,
  shared references kept) as arguments, updated in place after the call.

      @jaxstreams.nnx_jit(streams=3)
      def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

  The state of every module given (parameters, optimizer state, batch
  statistics, RNG counters) comes back updated; a step that adds or removes
  attributes of a module is not followed (``nnx.update`` raises). Results
  must be arrays (pytrees of them), not modules. Options are
  ``jaxstreams.jit``'s, less those that name argument positions.
  """
  return _decorator(_make_nnx, "nnx_jit", fun, streams, spread, gpu_lowering,
                    jit_kwargs)


def _make_nnx(fun: Callable, options: dict) -> SplitJit:
  from flax import nnx

  def modules(args, kwargs) -> tuple:
    """The modules among the arguments (optimizers and RNG streams too),
    in argument order: what the call updates."""
    is_module = lambda x: isinstance(x, nnx.Pytree)
    return tuple(x for x in jax.tree_util.tree_leaves((args, kwargs),
                                                      is_leaf=is_module)
                 if is_module(x))

  def pure(state, graphdef):
    args, kwargs = nnx.merge(graphdef, state)
    out = fun(*args, **kwargs)
    _check_nnx_results(fun, out, nnx)
    return out, nnx.state(modules(args, kwargs))
  pure.__name__ = pure.__qualname__ = _compat.function_name(fun)

  def split(*args, **kwargs):
    graphdef, state = nnx.split((args, kwargs))
    return state, graphdef

  def finish(args, kwargs, state, graphdef, result):
    out, new_state = result
    nnx.update(modules(args, kwargs), new_state)
    return out

  return SplitJit(fun, _jit.jit(pure, static_argnums=1, **options), split,
                  finish)


def _check_nnx_results(fun, out, nnx) -> None:
  is_module = lambda x: isinstance(x, nnx.Pytree)   # optimizers, rngs too
  for leaf in jax.tree_util.tree_leaves(out, is_leaf=is_module):
    if is_module(leaf):
      raise TypeError(
          f"jaxstreams.nnx_jit: {_compat.function_name(fun)} returned a "
          f"{type(leaf).__name__}; return arrays (the modules given are "
          f"updated in place), or nnx.state(module) and nnx.update it")


# ---------------------------------------------------------------------------
# equinox

def filter_jit(fun: Callable | None = None, *, streams: int | None = None,
               spread: bool | None = None, gpu_lowering: str | None = None,
               **jit_kwargs: Any):
  """``eqx.filter_jit`` on ``jaxstreams.jit``: every array of the arguments
  is traced, everything else (functions, ints, strings: the static fields
  of equinox modules) is static, and results may mix the two as well.

      @jaxstreams.filter_jit(streams=3)
      def step(model, x):
        return model(x)

  Options are ``jaxstreams.jit``'s, less those that name argument
  positions.
  """
  return _decorator(_make_filter, "filter_jit", fun, streams, spread,
                    gpu_lowering, jit_kwargs)


class _Static:
  """The non-array part of a pytree, hashable by its structure and leaves
  (what ``jax.jit`` needs of a static argument)."""

  def __init__(self, tree):
    self.leaves, self.treedef = jax.tree_util.tree_flatten(tree)
    self._key = (self.treedef, tuple(self.leaves))

  def tree(self):
    return jax.tree_util.tree_unflatten(self.treedef, self.leaves)

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, _Static) and self._key == other._key


def _make_filter(fun: Callable, options: dict) -> SplitJit:
  import equinox as eqx

  # The static part of each traced signature's results: a traced function
  # returns arrays only, and this gives the rest back. Keyed by the static
  # arguments and the arrays' types, so each signature finds its own.
  static_results: dict = {}

  def key(arrays, static):
    return (static, jax.tree_util.tree_structure(arrays),
            tuple((a.shape, str(a.dtype))
                  for a in jax.tree_util.tree_leaves(arrays)))

  def pure(arrays, static):
    args, kwargs = eqx.combine(arrays, static.tree())
    out_arrays, out_static = eqx.partition(fun(*args, **kwargs), eqx.is_array)
    static_results[key(arrays, static)] = out_static
    return out_arrays
  pure.__name__ = pure.__qualname__ = _compat.function_name(fun)

  def split(*args, **kwargs):
    arrays, static = eqx.partition((args, kwargs), eqx.is_array)
    return arrays, _Static(static)

  def finish(args, kwargs, arrays, static, out_arrays):
    return eqx.combine(out_arrays, static_results[key(arrays, static)])

  return SplitJit(fun, _jit.jit(pure, static_argnums=1, **options), split,
                  finish)
