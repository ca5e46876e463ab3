"""The batch program: one execution that runs a batch's requests side by side.

A batch of ``k`` requests (of one model or several) runs as one call of a
``jaxstreams.jit`` program in which request ``r`` is one opaque equation
(the ``jaxstreams_serve_request`` primitive) in ``stream(r + 1)``: a region
of its own, so on a GPU the ``k`` requests are parallel branches of the
program's CUDA graph (``gpu_lowering="concurrent"``: XLA draws the graph's
edges from data, and requests share none). Stream 0 only passes results
through. Nothing is copied into or out of a batch: each request's arrays are
arguments of the program as they are, and its results are outputs of their
own.

What is cached, and why:

* ``traced``: each model traced once per request *signature* (pytree
  structure and each leaf's shape, dtype, weak type and sharding). A Python
  exception ``f`` raises while traced belongs to that request alone, so it
  is met here, before a batch is built.
* ``programs``: one ``jaxstreams.jit`` function per *combination* of request
  keys (model and signature per slot), least recently used dropped first.
  A batch's requests are put in a canonical order (by when their key was
  first traced) before the combination is looked up, so requests arriving
  in any order share one program: a combination is a multiset.

A request's whole computation is one equation, which *flattens* any
``stream()`` blocks inside ``f``: the request runs whole on its slot's stream
(a slot is one compute stream; XLA:GPU has no streams within a stream).
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jcore
from jax import tree_util
from jax.interpreters import mlir

from jaxstreams import config
from jaxstreams._jit import jit as _streams_jit
from jaxstreams._signature import (signature as _leaf_signatures,
                                   traced_signature)
from jaxstreams._trace import trace
from jaxstreams.partition.cut import part_jaxpr
from jaxstreams.tag import stream as _stream

# The GPU way of every batch program, unless the jaxstreams_gpu_lowering
# option names one. The serve-level choice (``_choice``) decides whether
# batching pays at all; within a batch, requests are independent by
# construction, and CONCURRENT graphs run them side by side on every jax
# version (jaxstreams.lower.gpu), with no timing of ways per program.
GPU_LOWERING = "concurrent"


def _gpu_lowering() -> str | None:
  return GPU_LOWERING if config.read("jaxstreams_gpu_lowering") == "default" \
      else None


class _Traced:
  """A model traced for one request signature. Identity-hashed, so that it
  can be a primitive parameter, and opaque to the planner: the jaxpr sits in
  an attribute, where ``jaxprs_in_params`` does not look, so tags inside the
  model are invisible and the request is placed whole."""

  __slots__ = ("closed", "consts", "out_tree", "order", "__weakref__")

  def __init__(self, closed, out_tree, order: int):
    # The constants f closes over (model weights, typically) become leading
    # operands rather than constants baked into each request's code: the k
    # requests of a batch then share one copy of them instead of k.
    jaxpr = closed.jaxpr
    self.closed = part_jaxpr([*jaxpr.constvars, *jaxpr.invars], jaxpr.outvars,
                             jaxpr.eqns)
    self.consts = list(closed.consts)
    self.out_tree = out_tree
    self.order = order             # canonical position within a batch

  def __repr__(self) -> str:
    return f"<served request: {len(self.closed.jaxpr.eqns)} equations>"


request_p = jcore.Primitive("jaxstreams_serve_request")
request_p.multiple_results = True


@request_p.def_impl
def _request_impl(*args, traced: _Traced):
  return jcore.jaxpr_as_fun(traced.closed)(*args)


@request_p.def_effectful_abstract_eval
def _request_abstract_eval(*avals, traced: _Traced):
  del avals
  return traced.closed.out_avals, traced.closed.effects


def _request_lowering(ctx, *args, traced: _Traced):
  # Inline: the program XLA gets for a request is the one jax.jit(f) gives,
  # inside the request's region, so results are jax.jit's.
  return mlir.lower_fun(jcore.jaxpr_as_fun(traced.closed),
                        multiple_results=True)(ctx, *args)


mlir.register_lowering(request_p, _request_lowering)


def signature(payload) -> tuple:
  """What decides a request's trace: its pytree structure and each leaf's
  shape, dtype, weak type and sharding (``jaxstreams._signature``). Raises
  TypeError for a leaf jax.jit would refuse."""
  leaves, treedef = tree_util.tree_flatten(payload)
  return treedef, _leaf_signatures(leaves)


def _traced_signature(payload) -> tuple:
  """``signature`` of a request whose leaves are tracers of the batch trace."""
  leaves, treedef = tree_util.tree_flatten(payload)
  return treedef, traced_signature(leaves)


class LRU:
  """A dict bounded to ``bound`` entries, least recently used dropped first."""

  def __init__(self, bound: int):
    self.bound = bound
    self.items: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    self.evictions = 0

  def get(self, key):
    value = self.items.get(key)
    if value is not None:
      self.items.move_to_end(key)
    return value

  def put(self, key, value) -> None:
    self.items[key] = value
    self.items.move_to_end(key)
    while len(self.items) > self.bound:
      self.items.popitem(last=False)
      self.evictions += 1


class Programs:
  """The traced requests and compiled batch programs of one server.

  ``models`` is a sequence of ``(name, function)``; a request's *key* is
  ``(model index, signature)``."""

  def __init__(self, models: Sequence[tuple[str, Callable]], groups: int,
               max_programs: int):
    self.models = list(models)
    self.groups = groups
    self.lock = threading.RLock()      # tracing happens under it
    self.traced = LRU(max_programs * groups)
    self.programs = LRU(max_programs)
    self.signatures_traced = 0
    self.programs_traced = 0
    self._order = itertools.count()

  def key(self, model: int, payload) -> tuple:
    return model, signature(payload)

  def traced_for(self, key: tuple) -> _Traced:
    """The model of ``key`` traced for its signature (cached). Raises what
    the model raises while traced."""
    with self.lock:
      traced = self.traced.get(key)
      if traced is not None:
        return traced
      model, (treedef, leaves) = key
      args, kwargs = tree_util.tree_unflatten(
          treedef, [leaf.struct() for leaf in leaves])
      self.signatures_traced += 1
      closed, _, out_tree = trace(self.models[model][1], args, kwargs)
      traced = _Traced(closed, out_tree, next(self._order))
      self.traced.put(key, traced)
      return traced

  def program_for(self, keys: tuple):
    """The compiled function of one combination of keys, in that order."""
    with self.lock:
      fn = self.programs.get(keys)
      if fn is None:
        fn = self.batch_function(tuple(model for model, _ in keys),
                                 counted=True)
        self.programs.put(keys, fn)
      return fn

  def batch_function(self, models: tuple[int, ...] | None = None,
                     counted: bool = False):
    """A fresh ``jaxstreams.jit`` function of ``*requests`` (each an
    ``(args, kwargs)`` pair; request ``r`` of model ``models[r]``, or of the
    first model for every request where ``models`` is None) that runs
    request ``r`` on stream ``r + 1``. Fresh, so that evicting it from the
    LRU frees what jax.jit keeps for it."""
    this = weakref.ref(self)
    groups = self.groups

    def run_batch(*requests):
      programs = this()
      if len(requests) > groups:
        raise ValueError(f"a batch holds at most groups={groups} requests, "
                         f"got {len(requests)}")
      if models is not None and len(models) != len(requests):
        raise ValueError(f"this batch function runs {len(models)} requests "
                         f"(models {models}), got {len(requests)}")
      if counted:
        with programs.lock:
          programs.programs_traced += 1
      results = []
      for slot, request in enumerate(requests):
        model = 0 if models is None else models[slot]
        traced = programs.traced_for((model, _traced_signature(request)))
        leaves = tree_util.tree_leaves(request)
        with _stream(slot + 1):
          out = request_p.bind(*traced.consts, *leaves, traced=traced)
        results.append(tree_util.tree_unflatten(traced.out_tree, out))
      return tuple(results)

    names = sorted({self.models[m][0] for m in models or (0,)})
    run_batch.__name__ = run_batch.__qualname__ = "serve_" + "_".join(names)
    return _streams_jit(run_batch, streams=groups + 1,
                        gpu_lowering=_gpu_lowering())

  def run(self, keys: tuple, payloads: Sequence[tuple]) -> tuple:
    """Dispatch one batch (``keys`` in canonical order, ``payloads`` the
    matching ``(args, kwargs)``); returns each request's outputs, computed
    asynchronously."""
    return self.program_for(keys)(*payloads)

  def warm(self, keys: Sequence[tuple]) -> int:
    """Compile the program of every multiset of ``keys`` of 1 to ``groups``
    requests, by running each once on zeros; returns how many were new.
    Raises ValueError, compiling nothing, where they would not all fit in
    ``max_programs``."""
    with self.lock:
      order = {k: self.traced_for(k).order for k in keys}
    distinct = sorted(set(keys), key=order.get)
    combos = [c for k in range(1, self.groups + 1)
              for c in itertools.combinations_with_replacement(distinct, k)]
    if len(combos) > self.programs.bound:
      raise ValueError(
          f"warming up {len(distinct)} request signature(s) with groups="
          f"{self.groups} needs {len(combos)} batch programs, more than "
          f"max_programs={self.programs.bound} keeps: make the server with "
          f"max_programs >= {len(combos)}, or warm up fewer signatures")
    new = 0
    for combo in combos:
      with self.lock:
        new += self.programs.get(combo) is None
      payloads = [_zeros(key) for key in combo]
      jax.block_until_ready(self.run(combo, payloads))
    return new

  def stats(self) -> dict:
    with self.lock:
      return {"signatures_traced": self.signatures_traced,
              "programs_traced": self.programs_traced,
              "programs_cached": len(self.programs.items),
              "program_evictions": self.programs.evictions}


def _zeros(key: tuple) -> tuple:
  """An ``(args, kwargs)`` request of ``key``'s signature, all zeros: a weak
  type (a Python scalar's) stays weak, so the program is the one a real
  request of that signature meets."""
  _, (treedef, leaves) = key
  arrays = []
  for leaf in leaves:
    zero = leaf.dtype.type(0)
    if leaf.weak_type:
      zero = zero.item()
      arrays.append(zero if not leaf.shape
                    else jax.numpy.broadcast_to(zero, leaf.shape))
    else:
      arrays.append(jax.numpy.zeros(leaf.shape, leaf.dtype))
  return tree_util.tree_unflatten(treedef, arrays)
