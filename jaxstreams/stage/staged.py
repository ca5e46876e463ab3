"""``stage(x)`` and ``staged(step, data=...)``: software pipelining of a step.

A training step usually begins with work that depends only on the batch
(decoding, hashing, casting, feature crosses, the host-to-device copy) and
continues with work on parameters and state. The first part of batch
``k + 1`` does not need batch ``k``'s results, so it can run while batch
``k``'s second part runs: seed 004's staging areas (warm-up
``A0; A1 B0; A2 B1 C0; ...``), DeepRec's ``tf.staged`` and SmartStage.

How the step is split. ``staged`` traces the step once per batch shape to a
jaxpr and gives every top-level equation a *level*: the data argument's
leaves (and constants) are level 0, an equation is at the highest level of
its inputs, and a ``stage()`` marker adds one. Equations that read any other
argument (parameters, optimizer state) or have effects are *consumer*
equations, and so is everything that depends on them. With ``K`` the highest
marker level there are ``K`` producer stages and the consumer:

* ``smart=False``: producer stage ``l`` holds the data-only equations of level
  ``l`` that the markers need (what computes the staged value, as the issue
  says); the rest is the consumer's.
* ``smart=True``: every data-only equation that reads the data argument
  (directly or not) is staged, at stage ``min(level, max(K, 1) - 1)``: the
  widest subgraph that depends only on the data argument, SmartStage's
  choice, with or without ``stage()`` calls.

Constant-only equations, data-only ones that read no leaf of the data
(``jnp.arange(n)``, ``jnp.zeros``, arithmetic on closed-over constants), are
not staged values: every part (producer stage or consumer) that reads such a
value computes it itself, the consumer when none does. Per batch they would
be the same, so carrying them from part to part would only cost device
memory; one that two parts read runs in both (XLA folds most into
constants). The plan lists it in each part and marks it ``const``. A
``stage()`` call is staged as written, even on a constant.

A marker whose input depends on a non-data argument is an error naming that
argument: the producer runs ahead on later batches, so it would read the
parameters of an earlier step, silently.

How it runs, ``mode="fused"`` (the default). On a GPU, separate programs on
one device do not run their device work at the same time, so the producer
of batch ``k + 1`` can only overlap the consumer of batch ``k`` inside one
program. Each call therefore runs ONE ``jaxstreams.jit`` program that
computes the consumer part for batch ``k`` and producer stage ``j`` for
batch ``k + K - j`` (``K`` producer stages), the producer's equations under
``jaxstreams.stream(stream)``: on a GPU they become a call annotated with
that stream (``_xla_stream_annotation``) beside the consumer on the main
stream; on CPU regions are inlined. The staged values stay on the device
from call to call (the pipeline holds at most ``K + 1`` batches), as in seed
004: the first call warms up with ``A0; A1 B0; ...``, steady calls run
``A2 B1 C0``, and the last ones drain (``B4 C3``, ``C4``). A reader thread
(a ``Prefetcher``) pulls the batches from the iterable and places them on the
device ``capacity`` ahead. Once warm, a call takes a new batch into the
pipeline only if the reader has it ready (a slow read never delays the
consumer of a batch already staged; a later program catches up); programs
are cached per set of batch shapes in flight. ``stream=None`` picks the
first stream the step does not use itself (above its own ``stream()``
blocks, and ``N`` for ``jaxstreams.jit(streams=N)``), so the producer never
queues behind a consumer region; the program has ``max(N, stream + 1)``
streams.

Staged values are donated in fused mode. A value a producer stage made is
the runner's own, and dead once the program that reads it last has run, so
that program gets it with ``donate_argnums``: XLA then writes an output of
the same shape and dtype into its buffer (in the steady state, the next
batch's staged value) instead of allocating one. Never donated: a leaf of
the batch (placing an array that is already on the device returns that very
array, the caller's), a closed-over constant, the step's other arguments, a
value a later part of its batch still reads. Only as many values of a shape
and dtype are donated as the program has outputs of it (jax warns about, and
keeps, a buffer it cannot reuse). A failed program is run again part by part
to find the batch the error belongs to, and a failed run has taken its
donated buffers, so a part donates only when neither it nor a part of a
newer batch contains a host callback or foreign function call
(``_MAY_RAISE``, what can raise in a running program); should a part's input
be gone all the same (a failure of another kind), the error is raised by
this call, whichever batch it belongs to. ``mode="threads"`` donates
nothing: its stage programs stay plain jitted functions of the values handed
between threads.

``mode="threads"``. Each producer stage is a jitted function of the values
it needs, run by a ``jaxstreams.prefetch`` pipeline (one worker thread,
``capacity`` items ahead) over the previous stage's pipeline; stage 0's
worker also does the host-to-device copy of the batch. Workers wait until
their results are ready, so an item handed on is complete and memory is
bounded by ``capacity`` items per stage. The consumer runs in the caller's
thread, on values that are already there. On CPU this runs producer
computation on other cores (each program runs on its caller's thread); on a
GPU it hides host work and copies only.

Either way each equation is the one ``step`` would run, on the same inputs,
so the outputs are ``step``'s (bitwise on CPU).

``stage(x)`` outside a staged step (eagerly, under ``jax.jit`` or a plain
``jaxstreams.jit`` call) is the identity: the same step function can be run
staged and unstaged, and the unstaged loop is the reference the staged one is
checked against. Inside a trace it leaves one identity equation per leaf
(``checkpoint_name`` with a reserved name, an identity JAX differentiates,
batches and lowers already), which XLA removes.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import types
import weakref
from typing import Any, Callable, Iterable

import jax
import jax.extend.core as jcore
from jax import tree_util
from jax.ad_checkpoint import checkpoint_name

from jaxstreams import _compat
from jaxstreams import _checks
from jaxstreams._jit import spec_of
from jaxstreams._signature import signature as _signature
from jaxstreams._trace import trace
from jaxstreams.partition.cut import cut, part_function
from jaxstreams.stage.prefetch import NOT_READY, Prefetcher, next_if_ready
from jaxstreams.tag.read import any_equation, stream_ids

__all__ = ["stage", "staged", "staged_plan", "StagedPlan", "StagedRunner"]

STAGE_NAME = "jaxstreams_stage"
_FUNC = "jaxstreams.staged"


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


def _is_marker(eqn) -> bool:
  return eqn.primitive.name == "name" and eqn.params.get("name") == STAGE_NAME


def _nested_marker(eqn) -> bool:
  """Whether a ``stage()`` marker sits inside ``eqn`` (a nested jit, a loop
  body, a branch)."""
  return any(any_equation(sub.eqns, _is_marker)
             for sub in _compat.sub_jaxprs(eqn))


# ---------------------------------------------------------------------------
# The plan.

@dataclasses.dataclass(frozen=True)
class StagedEquation:
  index: int            # position in the step's jaxpr
  primitive: str
  source: str           # file:line (function) of the user code
  level: int | None     # None: reads a non-data argument or has effects
  constant: bool = False  # reads no argument: run by every part that needs it


@dataclasses.dataclass(frozen=True)
class StageSpec:
  index: int
  kind: str             # "producer" or "consumer"
  equations: tuple[StagedEquation, ...]
  inputs: int           # values it receives (the consumer: besides arguments)
  outputs: int          # values it hands on


@dataclasses.dataclass(frozen=True)
class StagedPlan:
  """How ``staged`` split a step: ``stages`` (producers first, the consumer
  last), ``boundaries`` (source of each ``stage()`` call and its level) and
  whether SmartStage chose the producer (``smart``)."""

  function_name: str
  smart: bool
  data_argnum: int
  stages: tuple[StageSpec, ...]
  boundaries: tuple[tuple[int, str], ...]

  @property
  def producers(self) -> tuple[StageSpec, ...]:
    return self.stages[:-1]

  @property
  def consumer(self) -> StageSpec:
    return self.stages[-1]

  def __str__(self) -> str:
    how = "smart (widest data-only subgraph)" if self.smart else "stage() calls"
    lines = [f"StagedPlan {self.function_name}: {len(self.producers)} producer "
             f"stage(s) + consumer, data argument {self.data_argnum}, "
             f"split by {how}"]
    for level, source in self.boundaries:
      lines.append(f"  boundary -> level {level}: stage() at {source}")
    for spec in self.stages:
      lines.append(f"  stage {spec.index} ({spec.kind}): {len(spec.equations)} "
                   f"equation(s), {spec.inputs} in, {spec.outputs} out")
      for eqn in spec.equations:
        level = "-" if eqn.level is None else eqn.level
        kind = "const" if eqn.constant else ""
        lines.append(f"    [{eqn.index:3d}] {eqn.primitive:<24} level {level:<2} "
                     f"{kind:<6}{eqn.source}")
    return "\n".join(lines)


class _Split:
  """The executable form of a plan for one batch signature: per stage, the
  variables it reads and hands on and its jitted function."""

  def __init__(self, plan: StagedPlan, other_invars, data_invars, consts,
               stage_ins, stage_outs, keep_after, fns, bodies, out_tree,
               other_sig):
    self.plan = plan
    self.other_invars = other_invars
    self.data_invars = data_invars
    self.const_vars, self.consts = consts
    self.stage_ins = stage_ins
    self.stage_outs = stage_outs
    self.keep_after = keep_after
    self.fns = fns          # jitted per stage (thread mode), None: no equations
    self.bodies = bodies    # the same as plain functions, to fuse (fused mode)
    self.out_tree = out_tree
    self.other_sig = other_sig


def _shapes(leaves) -> str:
  return ", ".join(f"{dtype}{list(shape)}{' (weak)' if weak else ''}"
                   for shape, dtype, weak, _ in _signature(leaves))


def _identity(item: Any) -> Any:
  return item


def _chain(first: Any, rest):
  """``first``, then ``rest``'s items (a generator, so closing it closes
  ``rest`` too when that is a generator)."""
  yield first
  yield from rest


# Primitives that can fail while a program runs, after it has taken its
# donated inputs: host callbacks and foreign function calls. XLA's own
# operations do not raise (bad indices clamp, NaNs propagate).
_MAY_RAISE = frozenset({"pure_callback", "io_callback", "debug_callback",
                        "debug_print", "ffi_call"})


def _may_raise(eqns) -> bool:
  return any_equation(eqns, lambda eqn: eqn.primitive.name in _MAY_RAISE)


def _build_split(fun: Callable, function_name: str, other_args: tuple,
                 kwargs: dict, batch: Any, data_argnum: int, smart: bool,
                 stream: int | None, consumer_jit: Callable) -> _Split:
  """Traces ``fun`` with ``batch`` at ``data_argnum`` and splits it."""
  position = data_argnum if data_argnum >= 0 else len(other_args) + 1 + data_argnum
  if not 0 <= position <= len(other_args):
    raise ValueError(
        f"{_FUNC}: data_argnum={data_argnum} does not name an argument of a "
        f"step called with {len(other_args)} other argument(s) plus the data "
        f"(valid: {-(len(other_args) + 1)} .. {len(other_args)})")
  args = other_args[:position] + (batch,) + other_args[position:]
  paths = [p for p, _ in tree_util.tree_flatten_with_path((args, kwargs))[0]]
  is_data = [len(p) > 1 and isinstance(p[0], tree_util.SequenceKey) and p[0].idx == 0
             and isinstance(p[1], tree_util.SequenceKey) and p[1].idx == position
             for p in paths]
  closed, leaves, out_tree = trace(fun, args, kwargs)
  jaxpr = closed.jaxpr
  names = {}
  for var, path, data in zip(jaxpr.invars, paths, is_data):
    # args[i] for positional, kwargs['k'] for keyword arguments.
    key = path[1:]
    names[var] = (f"args{tree_util.keystr(key)}" if path[0].idx == 0
                  else f"kwargs{tree_util.keystr(key)}")
  data_invars = [v for v, d in zip(jaxpr.invars, is_data) if d]
  other_invars = [v for v, d in zip(jaxpr.invars, is_data) if not d]
  data_name = f"args[{position}]"

  # Levels: int for data-only values, None for values that depend on other
  # arguments or effects (with the origin to name in errors).
  level: dict[Any, int | None] = {v: 0 for v in data_invars}
  level.update({v: 0 for v in jaxpr.constvars})
  origin: dict[Any, str] = {v: names[v] for v in other_invars}
  level.update({v: None for v in other_invars})
  eqn_level: list[int | None] = []
  # Values computed from a leaf of the data argument; a data-only equation
  # that reads none is constant-only (iota, zeros, closed-over constants).
  from_data: set = set(data_invars)
  constant: list[bool] = []
  markers: list[int] = []
  for i, eqn in enumerate(jaxpr.eqns):
    if _nested_marker(eqn):
      raise ValueError(
          f"{_FUNC}: jaxstreams.stage() is called inside a nested "
          f"'{eqn.primitive.name}' ({_compat.source_location(eqn)}); call it at "
          f"the top level of the step (pass the undecorated function, or a "
          f"jaxstreams.jit one, to staged)")
    lv: int | None = 0
    why = None
    for v in eqn.invars:
      if isinstance(v, jcore.Literal):
        continue
      if level[v] is None:
        lv, why = None, origin[v]
        break
      lv = max(lv, level[v])
    if lv is not None and eqn.effects:
      lv, why = None, (f"the effectful '{eqn.primitive.name}' at "
                       f"{_compat.source_location(eqn)}")
    if _is_marker(eqn):
      if lv is None:
        raise ValueError(
            f"{_FUNC}: the value passed to jaxstreams.stage() at "
            f"{_compat.source_location(eqn)} depends on {why}, which is not "
            f"the data argument {data_name}. The producer runs ahead on later "
            f"batches, so it would read {why} from an earlier step; compute "
            f"only from the data before stage(), and use {why} after it.")
      markers.append(i)
      out_lv = lv + 1
    else:
      out_lv = lv
    eqn_level.append(lv)
    reads_data = any(not isinstance(v, jcore.Literal) and v in from_data
                     for v in eqn.invars)
    if reads_data:
      from_data.update(eqn.outvars)
    constant.append(lv is not None and not reads_data and not _is_marker(eqn))
    for v in eqn.outvars:
      level[v] = out_lv
      if out_lv is None:
        origin[v] = why

  top = max((eqn_level[i] + 1 for i in markers), default=0)
  if top == 0 and not smart:
    raise ValueError(
        f"{_FUNC}: {function_name} calls no jaxstreams.stage(), so there is no "
        f"producer to run ahead; mark the boundary with jaxstreams.stage(x) "
        f"or pass smart=True to stage the widest data-only subgraph")
  n_producers = max(top, 1)

  # Which equations each producer stage runs.
  stage_of = [n_producers] * len(jaxpr.eqns)       # default: the consumer
  if smart:
    for i, lv in enumerate(eqn_level):
      if lv is not None and not constant[i]:
        stage_of[i] = min(lv, n_producers - 1)
  else:
    needed: set = set()
    for i in reversed(range(len(jaxpr.eqns))):
      eqn = jaxpr.eqns[i]
      if i in markers or (not constant[i]
                          and any(v in needed for v in eqn.outvars)):
        stage_of[i] = eqn_level[i]
        needed.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
  # A constant-only equation runs in every part that reads its value
  # (directly or through other constant-only equations), the consumer when
  # none does: constants are recomputed, never carried from part to part.
  parts = [{s} for s in stage_of]
  readers = collections.defaultdict(set)
  for v in jaxpr.outvars:
    readers[v].add(n_producers)
  for i in reversed(range(len(jaxpr.eqns))):
    eqn = jaxpr.eqns[i]
    if constant[i]:
      parts[i] = (set().union(*(readers[v] for v in eqn.outvars))
                  or {n_producers})
    for v in eqn.invars:
      if not isinstance(v, jcore.Literal):
        readers[v] |= parts[i]

  # Each part's inputs, outputs and function. The consumer takes the step's
  # other arguments first, then the values carried to it.
  n_stages = n_producers + 1
  members: list[list[int]] = [[] for _ in range(n_stages)]
  for i in range(len(jaxpr.eqns)):
    for s in parts[i]:
      members[s].append(i)
  cut_parts = cut(jaxpr, members, results_part=n_producers)
  other = set(other_invars)
  stage_ins = [list(part.inputs) for part in cut_parts]
  stage_ins[n_producers] = [v for v in stage_ins[n_producers] if v not in other]
  stage_outs = [list(part.outputs) for part in cut_parts]
  keep_after = [set().union(*stage_ins[s + 1:]) for s in range(n_stages)]
  part_eqns = [[jaxpr.eqns[i] for i in positions] for positions in members]
  fns, bodies = [], []
  for s in range(n_producers):
    if not members[s]:
      fns.append(None)
      bodies.append(None)
      continue
    body = part_function(stage_ins[s], stage_outs[s], part_eqns[s])
    bodies.append(body)
    if stream is not None:
      from jaxstreams import jit as streams_jit, stream as stream_scope

      def run(*xs, body=body):
        with stream_scope(stream):
          return body(*xs)
      fns.append(streams_jit(run, streams=stream + 1))
    else:
      fns.append(jax.jit(body))
  consumer = part_function(other_invars + stage_ins[n_producers],
                           jaxpr.outvars, part_eqns[n_producers])
  fns.append(consumer_jit(consumer))
  bodies.append(consumer)

  def describe(s):
    return tuple(
        StagedEquation(i, e.primitive.name, _compat.source_location(e),
                       eqn_level[i], constant[i])
        for i, e in zip(members[s], part_eqns[s]))
  stages = tuple(
      StageSpec(s, "producer" if s < n_producers else "consumer", describe(s),
                len(stage_ins[s]), len(stage_outs[s]) if s < n_producers
                else len(jaxpr.outvars))
      for s in range(n_stages))
  boundaries = tuple((eqn_level[i] + 1, _compat.source_location(jaxpr.eqns[i]))
                     for i in markers)
  plan = StagedPlan(function_name, smart, position, stages, boundaries)
  other_sig = _signature([leaf for leaf, d in zip(leaves, is_data) if not d])
  split = _Split(plan, other_invars, data_invars,
                (list(jaxpr.constvars), list(closed.consts)),
                stage_ins, stage_outs, keep_after, fns, bodies,
                out_tree, other_sig)
  # What fused programs donate (see ``_donated``): the values producer
  # stages made, the consumer's output types, and which parts may raise.
  split.staged = {v for outs in stage_outs[:n_producers] for v in outs}
  split.out_avals = [v.aval for v in jaxpr.outvars]
  split.may_raise = [_may_raise(eqns) for eqns in part_eqns]
  # Streams the step's own stream() blocks ask for: a fused program needs
  # them all, and the producer's default stream is the first one above them.
  split.streams_used = max(stream_ids(jaxpr), default=0) + 1
  return split


# ---------------------------------------------------------------------------
# The runner.

def _unwrap(step: Callable) -> tuple[Callable, Callable, str, Callable[[], int]]:
  """The function to trace, how to jit the consumer (thread mode), a name,
  and how many streams the step's own plan uses (read when a runner starts)."""
  spec = spec_of(step)
  name = getattr(step, "__qualname__", None) or getattr(step, "__name__", repr(step))
  if spec is not None:
    fun = spec.array_function(_FUNC)
    from jaxstreams import jit as streams_jit

    def consumer_jit(f):
      return streams_jit(f, streams=spec.streams)
    consumer_jit.cache_key = ("jaxstreams.jit", spec.streams)
    return fun, consumer_jit, name, spec.streams_now
  inner = getattr(step, "__wrapped__", None)
  if inner is not None and hasattr(step, "lower"):
    step = inner    # a jax.jit function: trace what it wraps, so stage() is visible
  return step, jax.jit, name, lambda: 1


# Splits by step function, so that a new runner over the same step (the next
# epoch) reuses the traced and compiled stage functions instead of compiling
# them again; weak, so a dropped step function frees its programs.
_SPLITS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_SPLITS_LOCK = threading.Lock()


def _per_fun_cache(fun) -> dict:
  try:
    with _SPLITS_LOCK:
      return _SPLITS.setdefault(fun, {})
  except TypeError:      # not weak-referenceable: no sharing across runners
    return {}


def _cached_split(producer, other_args, kwargs, batch, data_key) -> _Split:
  other = (other_args, kwargs)
  key = (data_key, tree_util.tree_structure(other),
         _signature(tree_util.tree_leaves(other)), producer.data_argnum,
         producer.smart, producer.stream, producer.consumer_key)
  per_fun = producer.cache
  split = per_fun.get(key)
  if split is None:
    split = _build_split(producer.fun, producer.name, other_args, kwargs, batch,
                         producer.data_argnum, producer.smart, producer.stream,
                         producer.consumer_jit)
    per_fun[key] = split
  return split


class _Producer:
  """What the stage workers run: the per-batch-shape splits and the producer
  stages. Kept apart from the runner so that worker threads never hold the
  runner: an abandoned runner is collected and its workers stop."""

  def __init__(self, fun, name, consumer_jit, data_argnum, smart, stream):
    self.fun, self.name, self.consumer_jit = fun, name, consumer_jit
    self.consumer_key = getattr(consumer_jit, "cache_key", consumer_jit)
    self.data_argnum, self.smart, self.stream = data_argnum, smart, stream
    self.cache = _per_fun_cache(fun)
    self.splits: dict[tuple, _Split] = {}
    self.lock = threading.Lock()
    self.other = None
    self.n_producers = 0

  def _split_for(self, batch: Any) -> _Split:
    data_leaves = tree_util.tree_leaves(batch)
    key = (tree_util.tree_structure(batch), _signature(data_leaves))
    with self.lock:
      split = self.splits.get(key)
      if split is None:
        other_args, kwargs = self.other
        split = _cached_split(self, other_args, kwargs, batch, key)
        if self.splits and len(split.plan.producers) != self.n_producers:
          raise ValueError(
              f"{_FUNC}: a batch of shapes ({_shapes(data_leaves)}) splits "
              f"{self.name} into {len(split.plan.producers)} producer "
              f"stage(s), the first batch into {self.n_producers}; the "
              f"number of stages must not depend on the batch's shapes")
        self.splits[key] = split
    return split

  def _first_stage(self, batch: Any):
    split = self._split_for(batch)
    env = dict(zip(split.const_vars, split.consts))
    # The host-to-device copy happens here, in the worker, not in the step.
    leaves = jax.device_put(tree_util.tree_leaves(batch))
    env.update(zip(split.data_invars, leaves))
    return self._run_stage(split, env, 0)

  def _later_stage(self, index: int):
    def run(item):
      split, env = item
      return self._run_stage(split, env, index)
    return run

  @staticmethod
  def _run_stage(split: _Split, env: dict, s: int):
    fn = split.fns[s]
    if fn is not None:
      outs = fn(*(env[v] for v in split.stage_ins[s]))
      # Ready before handed on: the next stage (or the step) never waits on
      # it, and ``capacity`` counts finished items.
      outs = jax.block_until_ready(outs)
      env = {**env, **dict(zip(split.stage_outs[s], outs))}
    keep = split.keep_after[s]
    return split, {v: x for v, x in env.items() if v in keep}


# ---------------------------------------------------------------------------
# Fused mode: one program per call.

class _DataError:
  """What the fused reader hands on for a batch whose reading or placing
  raised: the exception, delivered in the batch's place (a real
  ``KeyboardInterrupt`` in the caller's thread stays apart from one the
  iterable raised for batch ``k``, which is raised by call ``k``)."""

  __slots__ = ("exc",)

  def __init__(self, exc: BaseException):
    self.exc = exc


def _guarded(iterable: Iterable[Any]):
  """``iterable``'s items; an exception it raises becomes a ``_DataError``
  item, the last one. Closing this closes ``iterable`` when it is a
  generator (as the reader does for what it owns)."""
  iterator = iter(iterable)
  try:
    while True:
      try:
        item = next(iterator)
      except StopIteration:
        return
      except BaseException as exc:  # noqa: BLE001 - raised at its batch
        yield _DataError(exc)
        return
      yield item
  finally:
    if isinstance(iterator, types.GeneratorType):
      iterator.close()


def _place(batch: Any) -> Any:
  """The reader's transform in fused mode: the batch on the device, complete
  (the host-to-device copy happens in the reader thread, not in the step)."""
  if isinstance(batch, _DataError):
    return batch
  try:
    return jax.block_until_ready(jax.device_put(batch))
  except Exception as exc:  # noqa: BLE001 - raised at its batch
    return _DataError(exc)


class _InFlight:
  """A batch inside the fused pipeline: its split, the values its later
  stages and the consumer still need, how many producer stages it has done;
  or, for ``error``, the exception that batch ``index`` raised."""

  __slots__ = ("index", "split", "env", "done", "error")

  def __init__(self, index, split=None, env=None, error=None):
    self.index, self.split, self.env, self.error = index, split, env, error
    self.done = 0


def _layout(consumer: _Split | None, stages: tuple) -> list[tuple]:
  """The parts of a fused program in the order of its (flat) arguments, as
  ``(split, part, first argument)``: the consumer (part ``K``; the step's
  other arguments, then its carried values), then each producer stage ``j``
  that runs (part ``j``; its inputs)."""
  n, parts, first = len(stages), [], 0
  if consumer is not None:
    parts.append((consumer, n, 0))
    first = len(consumer.other_invars) + len(consumer.stage_ins[n])
  for j, split in enumerate(stages):
    if split is not None:
      parts.append((split, j, first))
      first += len(split.stage_ins[j])
  return parts


def _donated(consumer: _Split | None, stages: tuple) -> tuple[int, ...]:
  """The arguments a fused program donates, so that XLA can write its
  outputs into their buffers: values a producer stage made (the runner's
  own, never a leaf of the batch, a constant or an other argument) that no
  later part of their batch reads.

  Only as many of one shape and dtype as the program has outputs of that
  shape and dtype: jax reuses a donated buffer for such an output only, and
  warns about the others ("Some donated buffers were not usable"), which it
  leaves alone anyway. In the steady state the next batch's staged values
  take the buffers of the current one's.

  A program that fails is run again part by part, oldest batch first, up to
  the part that failed (``_Fused._run``), and a failed run has still taken
  its donated buffers. So a part donates only if neither it nor a part of a
  newer batch can raise while the program runs (``_MAY_RAISE``)."""
  n = len(stages)
  free = collections.Counter()
  for split, part, _ in _layout(consumer, stages):
    avals = (split.out_avals if part == n
             else [v.aval for v in split.stage_outs[part]])
    free.update((a.shape, a.dtype) for a in avals)
  donated = []
  # Newest batch first: stage 0, 1, ..., then the consumer.
  for split, part, first in sorted(_layout(consumer, stages),
                                   key=lambda p: p[1]):
    if split.may_raise[part]:
      break
    if part == n:
      first += len(split.other_invars)
    for i, v in enumerate(split.stage_ins[part]):
      key = (v.aval.shape, v.aval.dtype)
      if v in split.staged and v not in split.keep_after[part] and free[key]:
        free[key] -= 1
        donated.append(first + i)
  return tuple(sorted(donated))


def _fused_program(cache: dict, consumer: _Split | None,
                   stages: tuple, stream: int, streams: int) -> Callable:
  """The ``jaxstreams.jit`` program that runs, in one execution, the consumer
  part of ``consumer``'s batch (when not None) and producer stage ``j`` of
  the batch whose split is ``stages[j]`` (when not None), that stage's
  equations under ``stream(stream)``. Its arguments are flat, in
  ``_layout``'s order, so that single staged values can be donated
  (``_donated``). Cached by the splits' identities (the splits live in the
  same cache, so the ids stay theirs)."""
  key = ("fused", id(consumer), tuple(map(id, stages)), stream, streams)
  program = cache.get(key)
  if program is not None:
    return program
  from jaxstreams import jit as streams_jit, stream as stream_scope
  n = len(stages)
  layout = _layout(consumer, stages)
  ends = [first for _, _, first in layout[1:]] + [None]

  def fused(*flat):
    outs, produced = None, [None] * n
    for (split, part, first), end in zip(layout, ends):
      if part == n:
        # Emitted as in the step: untagged equations stay on the main stream.
        outs = split.bodies[n](*flat[first:end])
      else:
        # Equations the step placed itself keep their stream (innermost wins).
        with stream_scope(stream):
          produced[part] = split.bodies[part](*flat[first:end])
    return outs, produced

  fused.__name__ = fused.__qualname__ = "jaxstreams_staged_step"
  program = streams_jit(fused, streams=streams,
                        donate_argnums=_donated(consumer, stages))
  cache[key] = program
  return program


class _Fused:
  """The fused pipeline's state (the runner's, only used from the caller's
  thread; the reader thread holds none of it)."""

  def __init__(self, producer: _Producer, reader, n_producers: int,
               stream: int, streams: int):
    self.producer = producer
    self.reader = reader
    self.k = n_producers
    self.stream, self.streams = stream, streams
    self.inflight: collections.deque[_InFlight] = collections.deque()
    self.next_index = 0
    self.ended = False            # nothing more comes from the reader
    self.first = None             # the batch read to trace before starting
    self.warm = False             # the first call (warm-up) is over
    self.schedule: collections.deque[tuple] = collections.deque(maxlen=_SCHEDULE)
    self.programs = 0

  # Reading -------------------------------------------------------------------
  def _admit(self, block: bool) -> _InFlight | None:
    """The next batch from the reader, as a new in-flight entry; None when
    the reader has none ready (``block=False``) or has ended."""
    if self.ended:
      return None
    if self.first is not None:
      batch, self.first = self.first, None
    else:
      try:
        batch = next(self.reader) if block else next_if_ready(self.reader)
      except StopIteration:
        self.ended = True
        return None
      if batch is NOT_READY:
        return None               # not read yet: the consumer does not wait
    if isinstance(batch, _DataError):   # batch k's error, raised by call k
      self.ended = True
      self.inflight.append(_InFlight(self.next_index, error=batch.exc))
      self.next_index += 1
      return None
    split = self.producer._split_for(batch)
    env = dict(zip(split.const_vars, split.consts))
    env.update(zip(split.data_invars, tree_util.tree_leaves(batch)))
    entry = _InFlight(self.next_index, split, env)
    self.next_index += 1
    return entry

  # One program ---------------------------------------------------------------
  def _slots(self, consume: bool, block: bool):
    """Who runs in the next program: the consumer's batch (the head, when
    ``consume``) and, per producer stage ``j``, the in-flight batch that has
    done ``j`` stages (at most one: batches enter one per program)."""
    head = self.inflight[0] if consume else None
    stages: list[_InFlight | None] = [None] * self.k
    for entry in self.inflight:
      if entry is not head and entry.error is None and entry.done < self.k:
        stages[entry.done] = entry
    # A new batch enters at stage 0 while the pipeline holds fewer than
    # ``k`` batches besides the one consumed now (seed 004's depth).
    if stages[0] is None and len(self.inflight) - (1 if consume else 0) < self.k:
      entry = self._admit(block)
      if entry is not None:
        self.inflight.append(entry)
        stages[0] = entry
    return head, stages

  def _label(self, head, stages) -> tuple:
    """(part, batch index) of each piece; ``labels`` spells it out."""
    pieces = [(j, e.index) for j, e in enumerate(stages) if e is not None]
    if head is not None:
      pieces.append((self.k, head.index))
    return tuple(pieces)

  def labels(self) -> list[str]:
    """The schedule in seed 004's notation, formatted when asked for."""
    return [" ".join(f"{chr(ord('A') + part)}{index}" for part, index in pieces)
            for pieces in self.schedule]

  def _run(self, head, stages, other_leaves):
    """Runs one program; returns the consumer's flat outputs (or None)."""
    runnable = [e if e is not None and e.split.bodies[j] is not None else None
                for j, e in enumerate(stages)]
    for j, entry in enumerate(stages):
      if entry is not None and runnable[j] is None:   # a stage without work
        self._advance(entry, j, ())
    pieces = ([("consumer", head)] if head is not None else []) + [
        (j, e) for j, e in reversed(list(enumerate(runnable))) if e is not None]
    if not pieces:
      return None
    self.schedule.append(self._label(head, stages))
    self.programs += 1
    try:
      outs, produced = self._call(head, runnable, other_leaves)
    except Exception as exc:    # noqa: BLE001 - whose batch failed?
      if len(pieces) == 1:
        return self._failed(pieces[0], exc)
      # Run the pieces one by one, oldest batch first, to raise the error at
      # the batch it belongs to (a consumer with effects runs them again).
      outs = None
      for piece in pieces:
        who, entry = piece
        only = [None] * self.k
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in
               self._inputs(entry, self.k if who == "consumer" else who)):
          # Donated to the failed program (``_donated`` rules this out when
          # it knows how a program can fail): whose error it was cannot be
          # told, so it is this call's.
          raise exc
        try:
          if who == "consumer":
            outs, _ = self._call(entry, only, other_leaves)
          else:
            only[who] = entry
            _, produced = self._call(None, only, other_leaves)
            self._advance(entry, who, produced[who])
        except Exception as piece_exc:  # noqa: BLE001
          self._failed(piece, piece_exc)
          if who == "consumer":
            raise
          break   # newer batches were dropped with the failing one
      return outs
    for j, entry in enumerate(runnable):
      if entry is not None:
        self._advance(entry, j, produced[j])
    return outs

  def _call(self, head, runnable, other_leaves):
    program = _fused_program(
        self.producer.cache, None if head is None else head.split,
        tuple(None if e is None else e.split for e in runnable),
        self.stream, self.streams)
    args = [] if head is None else [*other_leaves, *self._inputs(head, self.k)]
    for j, entry in enumerate(runnable):
      if entry is not None:
        args += self._inputs(entry, j)
    return program(*args)

  @staticmethod
  def _inputs(entry: _InFlight, part: int) -> list:
    return [entry.env[v] for v in entry.split.stage_ins[part]]

  def _advance(self, entry: _InFlight, j: int, outs) -> None:
    split = entry.split
    env = entry.env
    if outs:
      env = {**env, **dict(zip(split.stage_outs[j], outs))}
    keep = split.keep_after[j]
    entry.env = {v: x for v, x in env.items() if v in keep}
    entry.done = j + 1

  def _failed(self, piece, exc):
    """Piece ``(who, entry)`` raised ``exc``: the consumer's error is raised
    now; a producer stage's error becomes its batch's, raised by the call
    for that batch, and nothing after that batch runs."""
    who, entry = piece
    if who == "consumer":
      raise exc
    keep = collections.deque()
    for e in self.inflight:
      if e.index < entry.index:
        keep.append(e)
    keep.append(_InFlight(entry.index, error=exc))
    self.inflight = keep
    self.ended = True
    self.reader.close()           # nothing is read past a failure
    return None

  # One call ------------------------------------------------------------------
  def step(self, other_leaves):
    """Runs until the head batch is consumed; returns its split and flat
    outputs."""
    # Warm-up (the first call) and catch-up: producer-only programs until
    # the oldest batch has done every stage: ``A0; A1 B0; ...``.
    while True:
      if not self.inflight:
        if self.ended:
          raise StopIteration
        block = True
      else:
        head = self.inflight[0]
        if head.error is not None:
          raise head.error
        if head.done == self.k:
          break
        block = not self.warm
      head, stages = self._slots(consume=False, block=block)
      if not self.inflight:
        continue                  # nothing came: ended, or the reader failed
      self._run(None, stages, other_leaves)
    head, stages = self._slots(consume=True, block=not self.warm)
    self.warm = True
    outs = self._run(head, stages, other_leaves)
    if self.inflight and self.inflight[0] is head:
      self.inflight.popleft()
    return head.split, outs


_SCHEDULE = 64        # programs the fused runner remembers for ``schedule``
MODES = ("fused", "threads")


class StagedRunner:
  """What ``jaxstreams.staged`` returns: call it with the step's other
  arguments to run the next batch. Raises ``StopIteration`` once the data is
  exhausted and drained; also an iterator-friendly context manager with
  ``close()``. ``plan`` is the ``StagedPlan`` of the latest batch (None
  before the first call); ``mode`` is ``"fused"`` or ``"threads"``;
  ``stream`` and ``streams`` (fused mode, from the first call on) the
  producer's stream and the stream count its program is compiled with."""

  def __init__(self, step: Callable, data: Iterable[Any], data_argnum: int,
               capacity: int, stream: int | None, smart: bool, mode: str):
    self._fun, self._consumer_jit, self._name, self._streams_now = _unwrap(step)
    self._data = data
    self.data_argnum = data_argnum
    self.capacity = capacity
    self.stream = stream
    self.streams: int | None = None
    self.smart = smart
    self.mode = mode
    self.plan: StagedPlan | None = None
    # In fused mode the producer is never jitted on its own with a stream:
    # the stream is applied inside the fused program.
    self._producer = _Producer(self._fun, self._name, self._consumer_jit,
                               data_argnum, smart,
                               stream if mode == "threads" else None)
    self._pipeline: Prefetcher | None = None
    self._stages: list[Prefetcher] = []
    self._fused: _Fused | None = None
    self._last_split: _Split | None = None
    self._done = False
    self._other_key = None          # the first call's (structure, signature)

  def _start(self, other_args: tuple, kwargs: dict) -> None:
    """Warm-up: trace with the first batch (in the caller, so a planning
    error is raised by this call), then start the reader (and, in thread
    mode, one worker per producer stage: they fill their ``capacity`` slots
    as in seed 004's ``A0; A1 B0; ...``)."""
    producer = self._producer
    producer.other = (other_args, kwargs)
    first_leaves, first_tree = tree_util.tree_flatten(producer.other)
    self._other_key = (first_tree, _signature(first_leaves))
    if self.mode == "fused":
      self._start_fused()
      return
    iterator = iter(self._data)
    self._data = None               # the pipeline owns the iterator now
    first = next(iterator)          # StopIteration: no data, nothing to run
    split = producer._split_for(first)
    producer.n_producers = len(split.plan.producers)
    self.plan = split.plan
    # The data is pulled by a thread of its own, so reading (I/O waits,
    # Python parsing) overlaps with stage 0's computation too.
    reader = Prefetcher(_chain(first, iterator), self.capacity,
                        transform=_identity, num_threads=1, timeout=None,
                        closed_exception_types=(StopIteration,),
                        ignored_exception_types=(), func=_FUNC)
    self._stages = [reader]
    pipe = Prefetcher(reader, self.capacity,
                      transform=producer._first_stage, num_threads=1, timeout=None,
                      closed_exception_types=(StopIteration,),
                      ignored_exception_types=(), func=_FUNC)
    self._stages.append(pipe)
    for index in range(1, producer.n_producers):
      pipe = Prefetcher(pipe, self.capacity,
                        transform=producer._later_stage(index), num_threads=1,
                        timeout=None, closed_exception_types=(StopIteration,),
                        ignored_exception_types=(), func=_FUNC)
      self._stages.append(pipe)
    self._pipeline = pipe

  def _start_fused(self) -> None:
    producer = self._producer
    # The reader thread pulls and places batches ``capacity`` ahead; the
    # first one is taken here, in the caller, to trace (a planning error is
    # raised by this call).
    reader = Prefetcher(_guarded(self._data), self.capacity, transform=_place,
                        num_threads=1, timeout=None,
                        closed_exception_types=(StopIteration,),
                        ignored_exception_types=(), func=_FUNC)
    self._data = None
    self._stages = [reader]
    first = next(reader)          # StopIteration: no data
    if isinstance(first, _DataError):
      raise first.exc
    split = producer._split_for(first)
    producer.n_producers = len(split.plan.producers)
    consumer_streams = max(self._streams_now(), split.streams_used)
    stream = consumer_streams if self.stream is None else self.stream
    self.stream, self.streams = stream, max(consumer_streams, stream + 1)
    self.plan = split.plan
    self._fused = _Fused(producer, reader, producer.n_producers,
                         self.stream, self.streams)
    self._fused.first = first

  # Consumer side ----------------------------------------------------------------
  def __call__(self, *other_args, **kwargs):
    if self._done:
      raise StopIteration
    call = (other_args, kwargs)
    try:
      if self._pipeline is None and self._fused is None:
        self._start(other_args, kwargs)
      leaves = self._check_other(call)
      if self._fused is not None:
        split, outs = self._fused.step(leaves)
      else:
        split, env = next(self._pipeline)
        carried = [env[v] for v in split.stage_ins[-1]]
        outs = split.fns[-1](*leaves, *carried)
    except BaseException:
      self.close()
      raise
    self.plan = split.plan
    self._last_split = split
    return tree_util.tree_unflatten(split.out_tree, outs)

  def _check_other(self, call) -> list:
    """The call's leaves, once checked against the first call's structure,
    shapes and dtypes (kept by ``_start``: this runs on every call)."""
    leaves, treedef = tree_util.tree_flatten(call)
    if (treedef, _signature(leaves)) != self._other_key:
      raise ValueError(
          f"{_FUNC}: the step's other arguments changed structure, shape or "
          f"dtype since the first call; a staged runner traces its producer "
          f"with the first call's arguments, so they must keep their shapes")
    return leaves

  @property
  def schedule(self) -> list[str]:
    """Fused mode: the latest programs run (up to 64), oldest first, in seed
    004's notation: ``"A2 B1 C0"`` is one program that ran producer stage A
    (stage 0) for batch 2, stage B for batch 1 and the consumer (the letter
    after the last stage) for batch 0. Empty in thread mode."""
    return [] if self._fused is None else self._fused.labels()

  def step_program(self) -> tuple[Callable, tuple]:
    """Fused mode: the steady-state program (consumer of batch ``k`` with
    every producer stage of the following batches) for the latest batch
    shapes, and its arguments as ``jax.ShapeDtypeStruct``s, to inspect it:
    ``program, args = runner.step_program();
    program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()``
    shows the producer inside calls annotated with ``stream``."""
    if self._fused is None or self._last_split is None:
      raise RuntimeError(f"{_FUNC}: step_program() needs a fused runner that "
                         "has run a call")
    split, k = self._last_split, self._fused.k
    stages = tuple(split if split.bodies[j] is not None else None
                   for j in range(k))
    program = _fused_program(self._producer.cache, split, stages,
                             self.stream, self.streams)

    def spec(v):
      a = v.aval
      return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
    args = [spec(v) for v in split.other_invars + split.stage_ins[k]]
    for j in range(k):
      if stages[j] is not None:
        args += [spec(v) for v in split.stage_ins[j]]
    return program, args

  @property
  def programs_run(self) -> int:
    """Fused mode: how many programs ran (one per call after the warm-up)."""
    return 0 if self._fused is None else self._fused.programs

  def staged_plan(self) -> StagedPlan:
    """What was staged: the ``StagedPlan`` of the latest batch (available
    from the first call on; ``jaxstreams.stage.staged_plan`` makes one from
    example arguments without running)."""
    if self.plan is None:
      raise RuntimeError(f"{_FUNC}: the runner has not traced a batch yet; call "
                         "it once, or use jaxstreams.stage.staged_plan(step, "
                         "*args) with an example batch")
    return self.plan

  def close(self) -> None:
    """Stops the reader and every stage's worker and waits for them;
    idempotent. Staged values still in flight are dropped."""
    self._done = True
    for stage_pipe in reversed(self._stages):
      stage_pipe.close()
    if self._fused is not None:
      self._fused.inflight.clear()
      self._fused.ended = True

  def __enter__(self) -> StagedRunner:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def __repr__(self) -> str:
    return (f"<jaxstreams.staged {self._name}, mode={self.mode!r}, "
            f"capacity={self.capacity}, smart={self.smart}>")

def _check_options(data_argnum, capacity, stream, smart, mode="fused"):
  if isinstance(data_argnum, bool) or not isinstance(data_argnum, int):
    raise TypeError(f"{_FUNC}: data_argnum must be an int (the position of the "
                    f"data argument, -1 for the last), got {data_argnum!r}")
  capacity = _checks.integer(capacity, name="capacity", context=_FUNC,
                             minimum=1)
  stream = _checks.integer(stream, name="stream", context=_FUNC, minimum=0,
                           meaning=" (0 is the main stream)", none_ok=True)
  if not isinstance(smart, bool):
    raise TypeError(f"{_FUNC}: smart must be True or False, got {smart!r}")
  if not isinstance(mode, str) or mode not in MODES:
    raise ValueError(f"{_FUNC}: mode must be one of {MODES}, got {mode!r}")
  return capacity, stream


def staged(step: Callable, data: Iterable[Any], *, data_argnum: int = -1,
           capacity: int = 1, stream: int | None = None,
           smart: bool = False, mode: str = "fused") -> StagedRunner:
  """Runs ``step`` as a software pipeline over the batches of ``data``.

  ``runner = jaxstreams.staged(step, data=batches)``; then each
  ``runner(*other_args)`` takes the next batch ``b``, and returns what
  ``step(*other_args, b)`` returns (``b`` goes in at ``data_argnum``), while
  the producer part of the step (what computes the ``jaxstreams.stage()``
  values from ``b``; with ``smart=True`` all of the step that depends only on
  ``b``) already runs for the following batches. The first call warms the
  pipeline up; once ``data`` is exhausted and drained, calls raise
  ``StopIteration``. An exception raised by ``data`` at batch ``k``, or by a
  producer stage's computation for batch ``k``, is raised by call ``k``.

  ``mode="fused"`` (the default): each call runs ONE ``jaxstreams.jit``
  program that computes the consumer part for batch ``k`` and, at the same
  time, producer stage ``j`` for batch ``k + K - j`` (``K`` producer stages),
  and hands the staged values on to the next call on the device: seed 004's
  software pipeline, ``A0; A1 B0`` on the first call (warm-up), then
  ``A2 B1 C0``, ``A3 B2 C1``, ... and ``B4 C3``, ``C4`` at the end (drain);
  ``runner.schedule`` lists the programs run in that notation. The producer
  part is placed on stream ``stream`` inside the program, so on a GPU it
  runs on its own CUDA stream beside the consumer (an annotated call, as for
  any ``jaxstreams.stream()`` block); on CPU it is inlined and the results
  are bitwise those of the unstaged step. ``stream=None`` picks the first
  stream the step does not use itself (one above its own ``stream()``
  blocks, ``N`` for a ``jaxstreams.jit(streams=N)`` step), and the program is
  compiled with ``streams = max(step's streams, stream + 1)``; ``stream=0``
  keeps the producer on the main stream (no overlap). A thread reads and
  places the batches on the device ahead of the programs that need them,
  at most ``capacity`` ahead; a call never waits for a batch the reader has
  not finished once the pipeline is warm (the program then runs without
  that producer stage, and a later program catches up). The staged values
  of at most ``K + 1`` batches are on the device at once.

  ``mode="threads"``: every producer stage is a program of its own run by a
  worker thread, ``capacity`` finished items ahead per stage, and the
  consumer runs in the caller's thread. On a GPU separate programs do not
  run their device work at the same time, so this hides only host work
  (reading, Python parsing, dispatch) and copies; on CPU, where each program
  runs on its caller's thread, producer work also runs on other cores,
  which helps when the producer's computation is heavy. ``stream`` tags the
  producer's programs.

  ``step`` is a plain function, a ``jaxstreams.jit`` function (its consumer
  part keeps its stream plan) or a ``jax.jit`` function (its wrapped function
  is traced). Its other arguments must keep their shapes from call to call.
  In fused mode, a consumer that uses ``jaxstreams.stream()`` blocks gets
  them honoured even for a plain or ``jax.jit`` step (the program is a
  ``jaxstreams.jit`` one), within the ``streams`` count above. When a fused
  program fails (on CPU, where errors are raised by the call), its parts are
  run again one by one to find the batch the error belongs to, so the
  consumer's side effects of that call may happen twice; on a GPU an error
  raised asynchronously by the device surfaces in the outputs of the call
  that ran it.
  """
  if not callable(step):
    raise TypeError(f"{_FUNC}: step must be callable, got {step!r} of type "
                    f"{type(step).__name__}")
  capacity, stream = _check_options(data_argnum, capacity, stream, smart, mode)
  try:
    iter(data)
  except TypeError:
    raise TypeError(f"{_FUNC}: data must be an iterable of batches, got "
                    f"{data!r} of type {type(data).__name__}") from None
  return StagedRunner(step, data, data_argnum, capacity, stream, smart, mode)


def staged_plan(step: Callable, *args, data_argnum: int = -1,
                smart: bool = False, **kwargs) -> StagedPlan:
  """The ``StagedPlan`` ``staged`` would make for ``step(*args, **kwargs)``,
  where ``args[data_argnum]`` is an example batch. Traces; runs nothing."""
  _check_options(data_argnum, 1, None, smart)
  fun, consumer_jit, name, _ = _unwrap(step)
  position = data_argnum if data_argnum >= 0 else len(args) + data_argnum
  if not 0 <= position < len(args):
    raise ValueError(f"{_FUNC}: data_argnum={data_argnum} does not name one of "
                     f"the {len(args)} argument(s)")
  other = args[:position] + args[position + 1:]
  return _build_split(fun, name, other, kwargs, args[position], position, smart,
                      None, consumer_jit).plan
