"""A step cut into ``staged``'s parts (producer stages, then the consumer):
which part each equation runs in. The data's leaves and constants are
level 0, an equation is at its inputs' highest level, a ``stage()`` marker
(``tag.boundary``) adds one; equations that read another argument or have
effects, and what depends on them, are the consumer's.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

import jax.extend.core as jcore
from jax import tree_util

from jaxstreams import _compat
from jaxstreams._trace import trace
from jaxstreams.partition.cut import cut, part_function
from jaxstreams.tag.boundary import is_marker
from jaxstreams.tag.read import any_equation, stream_ids, sub_jaxprs

FUNC = "jaxstreams.staged"

# Primitives that can fail while a program runs (XLA's own do not raise).
_MAY_RAISE = frozenset({"pure_callback", "io_callback", "debug_callback",
                        "debug_print", "ffi_call"})


# ``StagedPlan``: how ``staged`` split a step, for people to read.
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
  data_argnums: int     # the data argument's position, from 0
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
             f"stage(s) + consumer, data argument {self.data_argnums}, "
             f"split by {how}"]
    for level, source in self.boundaries:
      lines.append(f"  boundary -> level {level}: stage() at {source}")
    for spec in self.stages:
      lines.append(f"  stage {spec.index} ({spec.kind}): {len(spec.equations)} "
                   f"equation(s), {spec.inputs} in, {spec.outputs} out")
      for eqn in spec.equations:
        level = "-" if eqn.level is None else eqn.level
        kind = "const" if eqn.constant else ""
        lines.append(f"    [{eqn.index:3d}] {eqn.primitive:<24} "
                     f"level {level:<2} {kind:<6}{eqn.source}")
    return "\n".join(lines)


class Split:
  """A step split for one batch signature: per part (producer stages, then
  the consumer) the values it reads (``stage_ins``; the consumer's besides
  the other arguments), hands on (``stage_outs``) and its function
  (``bodies``; None for an empty stage)."""

  def __init__(self, *, plan: StagedPlan, other_invars, data_invars,
               const_vars, consts, stage_ins, stage_outs, bodies, out_tree,
               out_avals, may_raise, streams_used):
    self.plan = plan
    self.other_invars = other_invars
    self.data_invars = data_invars
    self.const_vars, self.consts = const_vars, consts
    self.stage_ins = stage_ins
    self.stage_outs = stage_outs
    # What an in-flight batch keeps after each part.
    self.keep_after = [set().union(*stage_ins[s + 1:])
                       for s in range(len(stage_ins))]
    self.bodies = bodies
    self.out_tree = out_tree
    # For donation: what producer stages made.
    self.staged = {v for outs in stage_outs[:-1] for v in outs}
    self.out_avals = out_avals
    self.may_raise = may_raise
    self.streams_used = streams_used

  def batch_env(self, data_leaves) -> dict:
    """The values a batch starts with: constants and the batch's leaves."""
    env = dict(zip(self.const_vars, self.consts))
    env.update(zip(self.data_invars, data_leaves))
    return env


def with_data(other_args: tuple, batch: Any, data_argnums: int
              ) -> tuple[tuple, int]:
  """The step's arguments, ``batch`` at ``data_argnums``, and its position."""
  position = (data_argnums if data_argnums >= 0
              else len(other_args) + 1 + data_argnums)
  return (*other_args[:position], batch, *other_args[position:]), position


def build_split(fun: Callable, function_name: str, other_args: tuple,
                kwargs: dict, batch: Any, data_argnums: int,
                smart: bool) -> Split:
  """Traces ``fun`` with ``batch`` at ``data_argnums`` and splits it."""
  args, position = with_data(other_args, batch, data_argnums)
  if not 0 <= position <= len(other_args):
    raise ValueError(
        f"{FUNC}: data_argnums={data_argnums} does not name an argument of a "
        f"step called with {len(other_args)} other argument(s) plus the data "
        f"(valid: {-(len(other_args) + 1)} .. {len(other_args)})")
  closed, _, out_tree = trace(fun, args, kwargs)
  jaxpr = closed.jaxpr
  is_data, names = _arguments(jaxpr, args, kwargs, position)
  data_invars = [v for v, d in zip(jaxpr.invars, is_data) if d]
  other_invars = [v for v, d in zip(jaxpr.invars, is_data) if not d]
  eqn_level, constant, markers = _levels(jaxpr, data_invars, other_invars,
                                         names, f"args[{position}]")
  top = max((eqn_level[i] + 1 for i in markers), default=0)
  if top == 0 and not smart:
    raise ValueError(
        f"{FUNC}: {function_name} calls no jaxstreams.stage(), so there is no "
        f"producer to run ahead; mark the boundary with jaxstreams.stage(x) "
        f"or pass smart=True to stage the widest data-only subgraph")
  n_producers = max(top, 1)
  members = _members(jaxpr, eqn_level, constant, set(markers), smart,
                     n_producers)

  # The consumer takes the step's other arguments first, then the values
  # carried to it.
  parts = cut(jaxpr, members, results_part=n_producers)
  other = set(other_invars)
  stage_ins = [list(part.inputs) for part in parts]
  stage_ins[n_producers] = [v for v in stage_ins[n_producers] if v not in other]
  stage_outs = [list(part.outputs) for part in parts]
  part_eqns = [[jaxpr.eqns[i] for i in positions] for positions in members]
  bodies = [part_function(stage_ins[s], stage_outs[s], part_eqns[s])
            if members[s] else None for s in range(n_producers)]
  bodies.append(part_function(other_invars + stage_ins[n_producers],
                              jaxpr.outvars, part_eqns[n_producers]))

  def describe(s):
    return tuple(
        StagedEquation(i, e.primitive.name, _compat.source_location(e),
                       eqn_level[i], constant[i])
        for i, e in zip(members[s], part_eqns[s]))
  stages = tuple(
      StageSpec(s, "producer" if s < n_producers else "consumer", describe(s),
                len(stage_ins[s]), len(stage_outs[s]) if s < n_producers
                else len(jaxpr.outvars))
      for s in range(n_producers + 1))
  boundaries = tuple((eqn_level[i] + 1, _compat.source_location(jaxpr.eqns[i]))
                     for i in markers)
  return Split(
      plan=StagedPlan(function_name, smart, position, stages, boundaries),
      other_invars=other_invars, data_invars=data_invars,
      const_vars=list(jaxpr.constvars), consts=list(closed.consts),
      stage_ins=stage_ins, stage_outs=stage_outs, bodies=bodies,
      out_tree=out_tree, out_avals=[v.aval for v in jaxpr.outvars],
      may_raise=[_may_raise(eqns) for eqns in part_eqns],
      streams_used=max(stream_ids(jaxpr), default=0) + 1)


def _arguments(jaxpr, args, kwargs, position) -> tuple[list[bool], dict]:
  """Per input of the jaxpr: whether it is a leaf of the data argument, and
  its name for errors (``args[0]['w']``, ``kwargs['k']``)."""
  paths = [p for p, _ in tree_util.tree_flatten_with_path((args, kwargs))[0]]
  is_data = [len(p) > 1 and isinstance(p[0], tree_util.SequenceKey)
             and p[0].idx == 0 and isinstance(p[1], tree_util.SequenceKey)
             and p[1].idx == position for p in paths]
  names = {var: (f"args{tree_util.keystr(path[1:])}" if path[0].idx == 0
                 else f"kwargs{tree_util.keystr(path[1:])}")
           for var, path in zip(jaxpr.invars, paths)}
  return is_data, names


def _levels(jaxpr, data_invars, other_invars, names, data_name):
  """Each equation's level (None: it depends on another argument or has
  effects), whether it is constant-only, and the markers' positions."""
  level: dict[Any, int | None] = {v: 0 for v in data_invars}
  level.update({v: 0 for v in jaxpr.constvars})
  origin: dict[Any, str] = {v: names[v] for v in other_invars}
  level.update({v: None for v in other_invars})
  eqn_level: list[int | None] = []
  # Values computed from the data; a data-only equation reading none is
  # constant-only.
  from_data: set = set(data_invars)
  constant: list[bool] = []
  markers: list[int] = []
  for i, eqn in enumerate(jaxpr.eqns):
    if any(any_equation(sub.eqns, is_marker)
           for sub in sub_jaxprs(eqn)):
      raise ValueError(
          f"{FUNC}: jaxstreams.stage() is called inside a nested "
          f"'{eqn.primitive.name}' ({_compat.source_location(eqn)}); call it "
          f"at the top level of the step (pass the undecorated function, or "
          f"a jaxstreams.jit one, to staged)")
    reads = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
    lv: int | None = 0
    why = None
    for v in reads:
      if level[v] is None:
        lv, why = None, origin[v]
        break
      lv = max(lv, level[v])
    if lv is not None and eqn.effects:
      lv, why = None, (f"the effectful '{eqn.primitive.name}' at "
                       f"{_compat.source_location(eqn)}")
    marker = is_marker(eqn)
    if marker and lv is None:
      raise ValueError(
          f"{FUNC}: the value passed to jaxstreams.stage() at "
          f"{_compat.source_location(eqn)} depends on {why}, which is not "
          f"the data argument {data_name}. The producer runs ahead on later "
          f"batches, so it would read {why} from an earlier step; compute "
          f"only from the data before stage(), and use {why} after it.")
    if marker:
      markers.append(i)
    eqn_level.append(lv)
    reads_data = any(v in from_data for v in reads)
    if reads_data:
      from_data.update(eqn.outvars)
    constant.append(lv is not None and not reads_data and not marker)
    out_lv = lv + 1 if marker else lv
    for v in eqn.outvars:
      level[v] = out_lv
      if out_lv is None:
        origin[v] = why
  return eqn_level, constant, markers


def _members(jaxpr, eqn_level, constant, markers: set, smart: bool,
             n_producers: int) -> list[list[int]]:
  """The positions of the equations each part runs (producer stages, then
  the consumer), in program order."""
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
  # (directly or through other constant-only ones), else in the consumer.
  parts = [{s} for s in stage_of]
  readers = collections.defaultdict(set)
  for v in jaxpr.outvars:
    if not isinstance(v, jcore.Literal):
      readers[v].add(n_producers)
  for i in reversed(range(len(jaxpr.eqns))):
    eqn = jaxpr.eqns[i]
    if constant[i]:
      parts[i] = (set().union(*(readers[v] for v in eqn.outvars))
                  or {n_producers})
    for v in eqn.invars:
      if not isinstance(v, jcore.Literal):
        readers[v] |= parts[i]
  members: list[list[int]] = [[] for _ in range(n_producers + 1)]
  for i, in_parts in enumerate(parts):
    for s in in_parts:
      members[s].append(i)
  return members


def _may_raise(eqns) -> bool:
  return any_equation(eqns, lambda eqn: eqn.primitive.name in _MAY_RAISE)
