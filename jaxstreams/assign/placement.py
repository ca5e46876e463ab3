"""Stream assignment: one stream per top-level equation, and why.

Rules, in order (the first that applies wins):

1. ``user``: the innermost ``jaxstreams.stream()`` block around the equation.
2. ``colocate``: a ``colocate_with(x)`` block: the stream of ``x``'s producer
   (a function argument or constant lives on the main stream).
3. ``body``: a control-flow or call equation (``scan``, ``while_loop``,
   ``cond``, ``checkpoint``, custom derivatives, nested jit with shardings)
   runs whole on one stream. If it is not itself inside a block but its body
   has blocks that all name one stream, it goes there. If they name several,
   it is left to the rules below and the plan notes the placements it could
   not honour: XLA runs a loop or branch body as one computation.
   ``inside``: a ``shard_map`` over all its mesh's axes whose body has
   blocks (or any, with spreading on), and is not itself in one, stays on
   the main stream and its body gets a plan of its own (each device runs the
   body as a program: its regions are calls there).
4. ``file``: the first line of the ``jaxstreams_stream_from_file`` rules
   whose regex matches the equation's name.
5. ``forward``: with ``jaxstreams_forward_propagation``, an equation whose
   inputs all come from equations placed (by rules 1-5) on one stream joins
   that stream.
6. ``spread``: with spreading on (``jaxstreams.jit(spread=True)``, the
   ``jaxstreams_spread`` option), the cost-model scheduler
   (``assign/spread.py``) spreads the rest over the streams; if the split
   does not pay, they stay on the main stream and the plan says so.
7. ``main``: everything else runs on stream 0.

An equation with side effects (``jax.debug.print``, callbacks, a mutable
array's allocation, reads, writes and freeze) always runs on the main
stream, whatever was asked, and spreading never moves it (rule ``effects``):
effects keep program order there, as under ``jax.jit`` (a read of a ref has
no data edge to the write before it). So does a collective (``psum``,
``all_gather``, ``ppermute``, ..., or an equation with one in its body;
rule ``collective``, which spreading never moves): XLA:GPU cannot compile
one inside a stream call. The plan notes each such move.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxstreams import _compat
from jaxstreams.assign.cost import COLLECTIVES
from jaxstreams.assign.rules import StreamRules
from jaxstreams.tag.read import ExposedProgram, Tag, effective_tag, sub_jaxprs


@dataclasses.dataclass(frozen=True)
class Placement:
  stream: int
  rule: str          # user, colocate, body, inside, file, forward, spread,
                     # main, effects, collective
  note: str = ""     # what could not be honoured, if anything


class StreamIdError(ValueError):
  """A ``stream()`` id outside ``[0, streams)``."""


def _check_range(stream_id: int, streams: int, streams_source: str,
                 eqn) -> None:
  if stream_id >= streams:
    raise StreamIdError(
        f"jaxstreams.stream({stream_id}) at {_compat.source_location(eqn)} is "
        f"outside [0, {streams}): the function has streams={streams} (from "
        f"{streams_source}). Use a stream id below {streams}, or raise streams "
        f"to at least {stream_id + 1}.")


def _inner_stream_tags(eqn, outer_stack, streams, streams_source,
                       found: dict[int, Any]) -> None:
  """Collect stream tags from the bodies of ``eqn`` (any depth) into
  ``found``."""
  for sub in sub_jaxprs(eqn):
    for inner in sub.eqns:
      stack = outer_stack + _compat.name_stack_entries(inner)
      tag = effective_tag(stack)
      if tag is not None and tag.kind == "stream":
        _check_range(tag.value, streams, streams_source, inner)
        found.setdefault(tag.value, inner)
      _inner_stream_tags(inner, stack, streams, streams_source, found)


def _has_collective(eqn) -> bool:
  """Whether ``eqn`` is a collective or runs one in a body (any depth).
  XLA:GPU compiles no collective inside a stream-annotated call ("No
  ExecutionStreamId found", jaxlib 0.10-0.12)."""
  return eqn.primitive.name in COLLECTIVES or any(
      _has_collective(inner) for sub in sub_jaxprs(eqn)
      for inner in sub.eqns)


def equation_name(eqn) -> str:
  """Name stack and primitive: what the plan shows and the rules file
  matches."""
  stack = _compat.name_stack_str(eqn)
  return f"{stack}/{eqn.primitive.name}" if stack else eqn.primitive.name


def assign_streams(program: ExposedProgram, streams: int, streams_source: str,
                   *, rules: StreamRules | None = None,
                   forward_propagation: bool = False,
                   plan_bodies: bool = False) -> list[Placement]:
  """A ``Placement`` for each top-level equation of ``program.jaxpr``, by
  rules 1-5 and 7 (``spread`` is applied by the caller, which can compare).
  ``rules`` is the rules file's content (rule 4), ``forward_propagation``
  turns on rule 5. ``plan_bodies`` (with spreading) plans every fully
  manual shard_map's body, blocks or not."""
  if rules is not None:
    rules.check_range(streams, streams_source)
  placements: list[Placement] = []
  for index, eqn in enumerate(program.jaxpr.eqns):
    stack = _compat.name_stack_entries(eqn)
    placement = _place(index, eqn, stack, effective_tag(stack), program,
                       placements, streams, streams_source, rules,
                       forward_propagation, plan_bodies)
    if placement.stream != 0 and _has_collective(eqn):
      placement = Placement(
          0, "collective", f"asked for stream {placement.stream} "
          f"({placement.rule}), but collectives run on the main stream: "
          "XLA:GPU cannot run one inside a stream call")
    elif placement.rule == "main" and _has_collective(eqn):
      # Nor may spreading move it.
      placement = Placement(0, "collective", placement.note)
    elif eqn.effects and placement.stream != 0:
      placement = Placement(
          0, "effects", f"asked for stream {placement.stream} "
          f"({placement.rule}), but equations with side effects run on the "
          "main stream")
    elif eqn.effects and placement.rule == "main":
      # Nor may spreading move it: effects (a ref's reads and writes, a
      # print) keep the main stream's program order.
      placement = Placement(0, "effects", placement.note)
    placements.append(placement)
  return placements


def _place(index, eqn, stack, tag: Tag | None, program, placements,
           streams, streams_source, rules: StreamRules | None,
           forward_propagation: bool, plan_bodies: bool) -> Placement:
  inner: dict[int, Any] = {}
  _inner_stream_tags(eqn, stack, streams, streams_source, inner)
  if tag is not None and tag.kind == "stream":
    _check_range(tag.value, streams, streams_source, eqn)
    others = sorted(set(inner) - {tag.value})
    note = (f"placements on streams {', '.join(map(str, others))} inside its "
            f"body run with it on stream {tag.value}") if others else ""
    return Placement(tag.value, "user", note)
  if tag is not None and tag.kind == "colocate":
    anchor = program.anchors.get(tag.value)
    if anchor is None:
      return Placement(0, "main", "colocate_with target was removed by a "
                       "transformation before planning; placed on main")
    source = program.producer_of(anchor)
    if source is None:
      return Placement(0, "colocate")   # an argument or constant: main stream
    return Placement(placements[source].stream, "colocate")
  if ((plan_bodies and streams > 1 or inner and set(inner) != {0})
      and _compat.shard_map_is_fully_manual(eqn)):
    # Every device runs the body as a program of its own: it is planned
    # apart (its regions on their streams), the shard_map stays on main.
    return Placement(0, "inside")
  if len(inner) == 1:
    return Placement(next(iter(inner)), "body")
  note = ""
  if len(inner) > 1:
    ids = ", ".join(str(s) for s in sorted(inner))
    note = (f"its body asks for streams {ids}; a {eqn.primitive.name} body "
            "runs as one computation, so it is placed as a whole")
  if rules is not None:
    matched = rules.match(equation_name(eqn))
    if matched is not None:
      stream, _ = matched
      return Placement(stream, "file", note)
  if forward_propagation:
    # Only placed inputs count: an unplaced ("main") producer may still be
    # moved by the scheduler, which would leave this equation behind.
    sources = [placements[p] for p in program.sources[index]]
    streams_in = {p.stream for p in sources}
    if len(streams_in) == 1 and all(p.rule != "main" for p in sources):
      return Placement(streams_in.pop(), "forward", note)
  return Placement(0, "main", note)
