"""Which ``Split`` a batch runs with: one per batch signature, cached per
step function across runners (weakly), so the next epoch's runner reuses
the traced and compiled parts. Splits are made for one signature of the
other arguments (``use_other``). Worker threads hold this, never the runner.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from jax import tree_util

from jaxstreams._signature import signature
from jaxstreams.partition.stages import FUNC, Split, build_split

_BY_FUNCTION: "weakref.WeakKeyDictionary[Any, dict]" = \
    weakref.WeakKeyDictionary()
_BY_FUNCTION_LOCK = threading.Lock()


def _per_function(fun) -> dict:
  try:
    with _BY_FUNCTION_LOCK:
      return _BY_FUNCTION.setdefault(fun, {})
  except TypeError:      # not weak-referenceable: no sharing across runners
    return {}


class Splits:
  """One runner's splits, in the step function's ``cache`` (fused programs
  share it)."""

  def __init__(self, fun: Callable, name: str, data_argnums: int,
               smart: bool):
    self.fun, self.name = fun, name
    self.data_argnums, self.smart = data_argnums, smart
    self.cache = _per_function(fun)
    self.other: tuple | None = None   # the (args, kwargs) splits are made for
    self._other_key = None            # ... their (structure, signature)
    self.n_producers: int | None = None   # the first split's producer stages
    self._mine: dict[tuple, Split] = {}
    self._lock = threading.Lock()

  def use_other(self, call: tuple) -> list:
    """Splits from now on are for the other arguments ``call`` (``(args,
    kwargs)``); returns its leaves."""
    leaves, treedef = tree_util.tree_flatten(call)
    key = (treedef, signature(leaves))
    with self._lock:
      if key != self._other_key:
        self.other, self._other_key = call, key
        self._mine.clear()
    return leaves

  def check_other(self, call: tuple) -> list:
    """``call``'s leaves, checked against those the splits are made for."""
    leaves, treedef = tree_util.tree_flatten(call)
    if (treedef, signature(leaves)) != self._other_key:
      raise ValueError(
          f"{FUNC}: the step's other arguments changed structure, shape or "
          f"dtype since staging began (the first call, or the call where "
          f"mode='measured' went back to staging); a staged runner traces "
          f"its producer and consumer with those arguments, so they must "
          f"keep their shapes while it stages")
    return leaves

  def split_for(self, batch: Any) -> Split:
    data_leaves = tree_util.tree_leaves(batch)
    key = (tree_util.tree_structure(batch), signature(data_leaves))
    with self._lock:
      split = self._mine.get(key)
      if split is None:
        split = self._shared(batch, key)
        if self.n_producers is None:
          self.n_producers = len(split.plan.producers)
        elif len(split.plan.producers) != self.n_producers:
          raise ValueError(
              f"{FUNC}: a batch of shapes ({_shapes(data_leaves)}) splits "
              f"{self.name} into {len(split.plan.producers)} producer "
              f"stage(s), the first batch into {self.n_producers}; the "
              f"number of stages must not depend on the batch's shapes")
        self._mine[key] = split
    return split

  def _shared(self, batch: Any, data_key: tuple) -> Split:
    other_args, kwargs = self.other
    key = (data_key, self._other_key, self.data_argnums, self.smart)
    split = self.cache.get(key)
    if split is None:
      split = build_split(self.fun, self.name, other_args, kwargs, batch,
                          self.data_argnums, self.smart)
      self.cache[key] = split
    return split


def _shapes(leaves) -> str:
  return ", ".join(f"{dtype}{list(shape)}{' (weak)' if weak else ''}"
                   for shape, dtype, weak, _ in signature(leaves))
