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
* ``smart=True``: every data-only equation is staged, at stage
  ``min(level, max(K, 1) - 1)``: the widest subgraph that depends only on the
  data argument, SmartStage's choice, with or without ``stage()`` calls.

A marker whose input depends on a non-data argument is an error naming that
argument: the producer runs ahead on later batches, so it would read the
parameters of an earlier step, silently.

How it runs. Each producer stage is a jitted function of the values it needs,
run by a ``jaxstreams.prefetch`` pipeline (one worker thread, ``capacity``
items ahead) over the previous stage's pipeline; stage 0's worker also does
the host-to-device copy of the batch. Workers wait until their results are
ready, so an item handed on is complete and memory is bounded by
``capacity`` items per stage. The consumer runs in the caller's thread, on
values that are already there. Each equation is the one ``step`` would run,
on the same inputs, so the outputs are ``step``'s.

``stage(x)`` outside a staged step (eagerly, under ``jax.jit`` or a plain
``jaxstreams.jit`` call) is the identity: the same step function can be run
staged and unstaged, and the unstaged loop is the reference the staged one is
checked against. Inside a trace it leaves one identity equation per leaf
(``checkpoint_name`` with a reserved name, an identity JAX differentiates,
batches and lowers already), which XLA removes.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import weakref
from typing import Any, Callable, Iterable

import jax
import jax.extend.core as jcore
from jax import tree_util
from jax.ad_checkpoint import checkpoint_name

from jaxstreams import _compat
from jaxstreams import _checks
from jaxstreams.stage.prefetch import Prefetcher

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


def _nested_marker(params: dict) -> bool:
  for value in params.values():
    for item in (value if isinstance(value, (tuple, list)) else (value,)):
      jaxpr = item.jaxpr if isinstance(item, jcore.ClosedJaxpr) else item
      if isinstance(jaxpr, jcore.Jaxpr):
        for eqn in jaxpr.eqns:
          if _is_marker(eqn) or _nested_marker(eqn.params):
            return True
  return False


# ---------------------------------------------------------------------------
# The plan.

@dataclasses.dataclass(frozen=True)
class StagedEquation:
  index: int            # position in the step's jaxpr
  primitive: str
  source: str           # file:line (function) of the user code
  level: int | None     # None: reads a non-data argument or has effects


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
        lines.append(f"    [{eqn.index:3d}] {eqn.primitive:<24} level {level:<2} "
                     f"{eqn.source}")
    return "\n".join(lines)


class _Split:
  """The executable form of a plan for one batch signature: per stage, the
  variables it reads and hands on and its jitted function."""

  def __init__(self, plan: StagedPlan, other_invars, data_invars, consts,
               stage_ins, stage_outs, keep_after, fns, out_tree, other_sig):
    self.plan = plan
    self.other_invars = other_invars
    self.data_invars = data_invars
    self.const_vars, self.consts = consts
    self.stage_ins = stage_ins
    self.stage_outs = stage_outs
    self.keep_after = keep_after
    self.fns = fns
    self.out_tree = out_tree
    self.other_sig = other_sig


def _signature(leaves) -> tuple:
  return tuple((tuple(jax.numpy.shape(x)), str(jax.numpy.result_type(x)))
               for x in leaves)


def _identity(item: Any) -> Any:
  return item


def _chain(first: Any, rest):
  """``first``, then ``rest``'s items (a generator, so closing it closes
  ``rest`` too when that is a generator)."""
  yield first
  yield from rest


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
  paths_leaves, in_tree = tree_util.tree_flatten_with_path((args, kwargs))
  paths = [p for p, _ in paths_leaves]
  leaves = [leaf for _, leaf in paths_leaves]
  is_data = [len(p) > 1 and isinstance(p[0], tree_util.SequenceKey) and p[0].idx == 0
             and isinstance(p[1], tree_util.SequenceKey) and p[1].idx == position
             for p in paths]
  out_tree_cell = []

  def flat_fun(*flat):
    call_args, call_kwargs = tree_util.tree_unflatten(in_tree, flat)
    out = fun(*call_args, **call_kwargs)
    out_leaves, out_tree = tree_util.tree_flatten(out)
    out_tree_cell.append(out_tree)
    return out_leaves

  closed = jax.make_jaxpr(flat_fun)(*leaves)
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
  markers: list[int] = []
  for i, eqn in enumerate(jaxpr.eqns):
    if _nested_marker(eqn.params):
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
      if lv is not None:
        stage_of[i] = min(lv, n_producers - 1)
  else:
    needed: set = set()
    for i in reversed(range(len(jaxpr.eqns))):
      eqn = jaxpr.eqns[i]
      if i in markers or any(v in needed for v in eqn.outvars):
        stage_of[i] = eqn_level[i]
        needed.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))

  # Per stage: inputs (defined earlier), outputs (used later).
  n_stages = n_producers + 1
  defined_in: dict[Any, int] = {v: -1 for v in data_invars}
  defined_in.update({v: -1 for v in jaxpr.constvars})
  defined_in.update({v: n_producers for v in other_invars})
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.outvars:
      defined_in[v] = stage_of[i]
  reads: list[dict] = [dict() for _ in range(n_stages)]   # ordered sets
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jcore.Literal) and defined_in[v] != stage_of[i]:
        reads[stage_of[i]][v] = None
  for v in jaxpr.outvars:
    if not isinstance(v, jcore.Literal) and defined_in[v] != n_producers:
      reads[n_producers][v] = None
  stage_ins = [list(r) for r in reads]
  stage_outs = []
  keep_after = []
  for s in range(n_stages):
    later = {v for t in range(s + 1, n_stages) for v in stage_ins[t]}
    keep_after.append(later)
    outs = [v for i, eqn in enumerate(jaxpr.eqns) if stage_of[i] == s
            for v in eqn.outvars if v in later]
    stage_outs.append(list(dict.fromkeys(outs)))

  # Functions.
  fns = []
  for s in range(n_producers):
    eqns = [e for i, e in enumerate(jaxpr.eqns) if stage_of[i] == s]
    if not eqns:
      fns.append(None)
      continue
    body = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(
        _compat.make_jaxpr(stage_ins[s], stage_outs[s], eqns), ()))
    if stream is not None:
      from jaxstreams import jit as streams_jit, stream as stream_scope

      def run(*xs, body=body):
        with stream_scope(stream):
          return body(*xs)
      fns.append(streams_jit(run, streams=stream + 1))
    else:
      fns.append(jax.jit(body))
  consumer_eqns = [e for i, e in enumerate(jaxpr.eqns) if stage_of[i] == n_producers]
  consumer_carried = [v for v in stage_ins[n_producers] if v not in set(other_invars)]
  stage_ins[n_producers] = consumer_carried
  consumer = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(_compat.make_jaxpr(
      other_invars + consumer_carried, jaxpr.outvars, consumer_eqns), ()))
  fns.append(consumer_jit(consumer))

  def describe(s):
    return tuple(
        StagedEquation(i, e.primitive.name, _compat.source_location(e), eqn_level[i])
        for i, e in enumerate(jaxpr.eqns) if stage_of[i] == s)
  stages = tuple(
      StageSpec(s, "producer" if s < n_producers else "consumer", describe(s),
                len(stage_ins[s]), len(stage_outs[s]) if s < n_producers
                else len(jaxpr.outvars))
      for s in range(n_stages))
  boundaries = tuple((eqn_level[i] + 1, _compat.source_location(jaxpr.eqns[i]))
                     for i in markers)
  plan = StagedPlan(function_name, smart, position, stages, boundaries)
  other_sig = _signature([leaf for leaf, d in zip(leaves, is_data) if not d])
  return _Split(plan, other_invars, data_invars,
                (list(jaxpr.constvars), list(closed.consts)),
                stage_ins, stage_outs, keep_after, fns, out_tree_cell[0],
                other_sig)


# ---------------------------------------------------------------------------
# The runner.

def _unwrap(step: Callable) -> tuple[Callable, Callable, str]:
  """The function to trace, how to jit the consumer, and a name."""
  spec = getattr(step, "_jaxstreams_spec", None)
  name = getattr(step, "__qualname__", None) or getattr(step, "__name__", repr(step))
  if spec is not None:
    static = {k for k in ("static_argnums", "static_argnames") if spec.jit_kwargs.get(k)}
    if static:
      raise ValueError(f"{_FUNC}: {name} has {sorted(static)}; a staged step "
                       "takes array arguments only")
    from jaxstreams import jit as streams_jit

    def consumer_jit(f):
      return streams_jit(f, streams=spec.streams)
    consumer_jit.cache_key = ("jaxstreams.jit", spec.streams)
    return spec.fun, consumer_jit, name
  inner = getattr(step, "__wrapped__", None)
  if inner is not None and hasattr(step, "lower"):
    step = inner    # a jax.jit function: trace what it wraps, so stage() is visible
  return step, jax.jit, name


# Splits by step function, so that a new runner over the same step (the next
# epoch) reuses the traced and compiled stage functions instead of compiling
# them again; weak, so a dropped step function frees its programs.
_SPLITS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_SPLITS_LOCK = threading.Lock()


def _cached_split(producer, other_args, kwargs, batch, data_key) -> _Split:
  other = (other_args, kwargs)
  key = (data_key, tree_util.tree_structure(other),
         _signature(tree_util.tree_leaves(other)), producer.data_argnum,
         producer.smart, producer.stream, producer.consumer_key)
  try:
    with _SPLITS_LOCK:
      per_fun = _SPLITS.setdefault(producer.fun, {})
  except TypeError:      # not weak-referenceable: no sharing across runners
    per_fun = {}
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
              f"{_FUNC}: a batch of shapes {_signature(data_leaves)} splits "
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


class StagedRunner:
  """What ``jaxstreams.staged`` returns: call it with the step's other
  arguments to run the next batch. Raises ``StopIteration`` once the data is
  exhausted and drained; also an iterator-friendly context manager with
  ``close()``. ``plan`` is the ``StagedPlan`` of the latest batch (None
  before the first call)."""

  def __init__(self, step: Callable, data: Iterable[Any], data_argnum: int,
               capacity: int, stream: int | None, smart: bool):
    self._fun, self._consumer_jit, self._name = _unwrap(step)
    self._data = data
    self.data_argnum = data_argnum
    self.capacity = capacity
    self.stream = stream
    self.smart = smart
    self.plan: StagedPlan | None = None
    self._producer = _Producer(self._fun, self._name, self._consumer_jit,
                               data_argnum, smart, stream)
    self._pipeline: Prefetcher | None = None
    self._stages: list[Prefetcher] = []
    self._done = False

  def _start(self, other_args: tuple, kwargs: dict) -> None:
    """Warm-up: trace with the first batch (in the caller, so a planning
    error is raised by this call), then start one worker per producer stage;
    they fill their ``capacity`` slots as in seed 004's ``A0; A1 B0; ...``."""
    producer = self._producer
    producer.other = (other_args, kwargs)
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

  # Consumer side ----------------------------------------------------------------
  def __call__(self, *other_args, **kwargs):
    if self._done:
      raise StopIteration
    try:
      if self._pipeline is None:
        self._start(other_args, kwargs)
      split, env = next(self._pipeline)
    except BaseException:
      self.close()
      raise
    call = (other_args, kwargs)
    if (tree_util.tree_structure(call) != tree_util.tree_structure(self._producer.other)
        or _signature(tree_util.tree_leaves(call)) != split.other_sig):
      self.close()
      raise ValueError(
          f"{_FUNC}: the step's other arguments changed structure, shape or "
          f"dtype since the first call; a staged runner traces its producer "
          f"with the first call's arguments, so they must keep their shapes")
    self.plan = split.plan
    carried = [env[v] for v in split.stage_ins[-1]]
    outs = split.fns[-1](*tree_util.tree_leaves(call), *carried)
    return tree_util.tree_unflatten(split.out_tree, outs)

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
    """Stops every stage's worker and waits for them; idempotent."""
    self._done = True
    for stage_pipe in reversed(self._stages):
      stage_pipe.close()

  def __enter__(self) -> StagedRunner:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def __repr__(self) -> str:
    return (f"<jaxstreams.staged {self._name}, capacity={self.capacity}, "
            f"smart={self.smart}>")


def _check_options(data_argnum, capacity, stream, smart):
  if isinstance(data_argnum, bool) or not isinstance(data_argnum, int):
    raise TypeError(f"{_FUNC}: data_argnum must be an int (the position of the "
                    f"data argument, -1 for the last), got {data_argnum!r}")
  capacity = _checks.integer(capacity, name="capacity", context=_FUNC,
                             minimum=1)
  stream = _checks.integer(stream, name="stream", context=_FUNC, minimum=0,
                           meaning=" (0 is the main stream)", none_ok=True)
  if not isinstance(smart, bool):
    raise TypeError(f"{_FUNC}: smart must be True or False, got {smart!r}")
  return capacity, stream


def staged(step: Callable, data: Iterable[Any], *, data_argnum: int = -1,
           capacity: int = 1, stream: int | None = None,
           smart: bool = False) -> StagedRunner:
  """Runs ``step`` as a software pipeline over the batches of ``data``.

  ``runner = jaxstreams.staged(step, data=batches)``; then each
  ``runner(*other_args)`` takes the next batch ``b``, and returns what
  ``step(*other_args, b)`` returns (``b`` goes in at ``data_argnum``), while
  the producer part of the step (what computes the ``jaxstreams.stage()``
  values from ``b``; with ``smart=True`` all of the step that depends only on
  ``b``) already runs for the next batches, ``capacity`` items ahead per
  stage. The first call warms the pipeline up; once ``data`` is exhausted and
  drained, calls raise ``StopIteration``. An exception raised by ``data`` at
  batch ``k`` is raised by call ``k``.

  ``step`` is a plain function, a ``jaxstreams.jit`` function (its consumer
  part keeps its stream plan) or a ``jax.jit`` function (its wrapped function
  is traced). Its other arguments must keep their shapes from call to call.
  ``stream``: the producer's equations are tagged for that stream (the
  ``stage_subgraph_stream_id`` of SmartStage).
  """
  if not callable(step):
    raise TypeError(f"{_FUNC}: step must be callable, got {step!r} of type "
                    f"{type(step).__name__}")
  capacity, stream = _check_options(data_argnum, capacity, stream, smart)
  try:
    iter(data)
  except TypeError:
    raise TypeError(f"{_FUNC}: data must be an iterable of batches, got "
                    f"{data!r} of type {type(data).__name__}") from None
  return StagedRunner(step, data, data_argnum, capacity, stream, smart)


def staged_plan(step: Callable, *args, data_argnum: int = -1,
                smart: bool = False, **kwargs) -> StagedPlan:
  """The ``StagedPlan`` ``staged`` would make for ``step(*args, **kwargs)``,
  where ``args[data_argnum]`` is an example batch. Traces; runs nothing."""
  _check_options(data_argnum, 1, None, smart)
  fun, consumer_jit, name = _unwrap(step)
  position = data_argnum if data_argnum >= 0 else len(args) + data_argnum
  if not 0 <= position < len(args):
    raise ValueError(f"{_FUNC}: data_argnum={data_argnum} does not name one of "
                     f"the {len(args)} argument(s)")
  other = args[:position] + args[position + 1:]
  return _build_split(fun, name, other, kwargs, args[position], position, smart,
                      None, consumer_jit).plan
