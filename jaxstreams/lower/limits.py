"""What XLA:GPU cannot compile inside a stream call, jaxlib by jaxlib.

A region becomes a stream call only where the installed XLA compiles it.
Found by compiling programs of every shape for an H100 without one
(``tests/compile_matrix.py``, on every supported jax); docs/xla.md names the
constructs for upstream reports:

* jaxlib 0.12: a constant inside a stream call crashes XLA's compiler (a
  segmentation fault while it emits the program, or ptxas rejecting the
  constant's unsanitized name): XLA compiles the call on its "parallel"
  execution thread, where it leaves constant names as they are. Every loop
  has one (its counter starts at a constant). Constants jaxstreams passes
  into a call go through an optimization barrier, so XLA cannot copy them
  in; constants XLA makes inside the call cannot be kept out.
* jaxlib 0.11: a loop that slices its stacked operands by its counter (a
  ``lax.scan`` over layers) fails to compile inside a stream call ("No
  ExecutionStreamId found" for the asynchronous copy XLA makes of each
  slice).
* jaxlib 0.12: an optimization barrier inside a stream call fails to
  compile ("Unsupported instruction opcode: opt-barrier"); ``jax.checkpoint``
  puts its recomputation behind barriers unless ``prevent_cse=False``.
* jaxlib 0.11 and 0.12: a loop body whose call reads the step's incoming
  carry in an operation that depends on the one writing the outgoing carry
  (``c2 = f(c); y = c2 + c``) aborts XLA's compiler ("Check failed:
  schedule.size() == computation_->instruction_count()"): the loop-schedule
  linearizer orders every reader of a carried value before its writer,
  checking for cycles only among the loop body's own instructions, not the
  call's.
* Collectives compile nowhere inside a stream call (lowering keeps them on
  the main stream; not handled here).

Loops are not lost to this: independent ones run as one loop with each body
on its stream (``jaxstreams.lower.loops``), which every jaxlib compiles.
"""

from __future__ import annotations

import itertools
import types
from typing import Callable, Collection, Sequence

import jax.extend.core as jcore

from jaxstreams import _compat
from jaxstreams.tag.read import any_equation

LOOPS = frozenset({"while", "scan"})
# jax.checkpoint's primitive: with prevent_cse (its default) XLA gets its
# recomputation behind optimization barriers.
REMAT = "remat2"
BARRIER = "optimization_barrier"
_JAXLIB = _compat.jaxlib_version()


class LoweringError(ValueError):
  """A ``gpu_lowering`` asked for that XLA:GPU cannot compile for a region
  of this program with the installed jaxlib (found before compiling: XLA
  would crash or fail there)."""


def region_hazard(held: frozenset[str]) -> str | None:
  """Why the installed XLA cannot compile a region that binds the
  primitives ``held`` (``Region.holds``) as one stream call, or None."""
  return _hazard(bool(held & LOOPS), bool(held & {BARRIER, REMAT}))


def regions_in_place(streams: Sequence[int],
                     holds: Callable[[int], frozenset[str]],
                     grouped: Collection[int]) -> dict[int, str]:
  """The off-main regions (of plan streams ``streams``, by index) that the
  installed XLA cannot compile as stream calls, and why; ``holds(index)``
  gives a region's primitives, and the regions ``grouped`` run as one loop
  instead. Asked once per plan, before emission (``lower/decide.py``):
  the plan keeps the answer, which emission and the report both read."""
  found = {}
  for index, stream in enumerate(streams):
    if stream != 0 and index not in grouped:
      why = region_hazard(holds(index))
      if why is not None:
        found[index] = why
  return found


def body_hazard(eqns) -> str | None:
  """Why the installed XLA cannot compile a loop's body ``eqns`` as one
  stream call per step, or None. Its top-level ``jax.checkpoint`` equations
  are emitted without their barriers (``without_cse_barriers``)."""
  kept = without_cse_barriers(eqns)
  return _hazard(any_equation(kept, lambda eqn: eqn.primitive.name in LOOPS),
                 any_equation(kept, _is_barrier))


def carry_hazard(jaxpr, num_consts: int, num_carry: int) -> str | None:
  """Why the installed XLA cannot compile the loop body ``jaxpr`` (a scan's:
  constants, carry, slices in; carry, results out) as a stream call per
  step for its carry, or None: where an operation that reads the incoming
  carry depends on the one that writes that carry's next value (XLA's
  loop-schedule linearizer would order it before that writer, a cycle).
  Calls, jits and derivative wrappers are looked into: XLA inlines them."""
  if _JAXLIB < (0, 11):
    return None
  names: dict[int, int] = {}   # id(variable) -> its value's number
  for number, var in enumerate([*jaxpr.constvars, *jaxpr.invars]):
    names[id(var)] = number
  ops: list[tuple[set[int], set[int]]] = []   # values read, values written
  _flatten(jaxpr.eqns, names, ops, itertools.count(len(names)))
  writer_of = {v: k for k, (_, wrote) in enumerate(ops) for v in wrote}
  carry_in = jaxpr.invars[num_consts:num_consts + num_carry]
  carry_out = jaxpr.outvars[:num_carry]
  for k, (cin, cout) in enumerate(zip(carry_in, carry_out)):
    writer = writer_of.get(names.get(id(cout)))
    if writer is None:
      continue   # passed through, a literal, or a constant
    downstream = set(ops[writer][1])
    for reads, writes in ops[writer + 1:]:
      if reads & downstream:
        if names[id(cin)] in reads:
          return (f"an operation of it reads its carry {k} after the one "
                  f"that writes that carry's next value, and XLA of jaxlib "
                  f"{_compat.jaxlib_text()} aborts compiling that inside a "
                  "stream call in a loop (its loop-schedule linearizer "
                  "orders the reading before the writing: a cycle)")
        downstream |= writes
  return None


def carry_tail(jaxpr, num_consts: int, num_carry: int
               ) -> tuple[int, ...] | None:
  """Where ``carry_hazard`` finds the loop body ``jaxpr`` cannot be one
  stream call: the positions of its top-level equations that, run after
  the call on the main stream, leave a call XLA compiles, or None. They
  are each equation that reads the incoming carry after one writing the
  outgoing carry, and everything that depends on those; none may write
  a carry (the next step's call needs it), and what stays in the call
  must pass ``carry_hazard`` (a reading inside one nested jit cannot be
  taken out)."""
  carry_in = {id(v) for v in jaxpr.invars[num_consts:num_consts + num_carry]}
  carry_out = {id(v) for v in jaxpr.outvars[:num_carry]}
  after_writer: set[int] = set()   # values downstream of a carry's writer
  tail_values: set[int] = set()    # values the tail makes
  tail = []
  for position, eqn in enumerate(jaxpr.eqns):
    reads = {id(v) for v in eqn.invars if not isinstance(v, jcore.Literal)}
    made = {id(v) for v in eqn.outvars}
    if reads & tail_values or (reads & after_writer and reads & carry_in):
      tail.append(position)
      tail_values |= made
    if reads & after_writer or made & carry_out:
      after_writer |= made
  if not tail or tail_values & carry_out:
    return None
  moved = set(tail)
  head = types.SimpleNamespace(
      constvars=jaxpr.constvars, invars=jaxpr.invars, outvars=jaxpr.outvars,
      eqns=[e for i, e in enumerate(jaxpr.eqns) if i not in moved])
  if carry_hazard(head, num_consts, num_carry) is not None:
    return None
  return tuple(tail)


_INLINED = _compat.NESTED_JIT_PRIMITIVES | _compat.DERIVATIVE_WRAPPERS


def _flatten(eqns, names: dict[int, int], ops: list, fresh) -> None:
  """``eqns`` as XLA sees them, appended to ``ops`` in order as (values
  read, values written), calls and wrappers inlined. ``names`` numbers
  the values of the variables in scope (by ``id``); ``fresh`` numbers new
  ones (an inlined jaxpr's own, afresh each time it is inlined)."""
  for eqn in eqns:
    reads = {names[id(v)] for v in eqn.invars
             if not isinstance(v, jcore.Literal) and id(v) in names}
    inner = (_compat.nested_jaxpr(eqn.params)
             if eqn.primitive.name in _INLINED else None)
    if (inner is not None and len(inner.jaxpr.invars) == len(eqn.invars)
        and len(inner.jaxpr.outvars) == len(eqn.outvars)):
      scope = {id(v): next(fresh) for v in inner.jaxpr.constvars}
      for var, outer in zip(inner.jaxpr.invars, eqn.invars):
        scope[id(var)] = (names[id(outer)] if id(outer) in names
                          else next(fresh))
      _flatten(inner.jaxpr.eqns, scope, ops, fresh)
      for var, result in zip(eqn.outvars, inner.jaxpr.outvars):
        names[id(var)] = scope.get(id(result), next(fresh))
      continue
    written = set()
    for var in eqn.outvars:
      names[id(var)] = next(fresh)
      written.add(names[id(var)])
    ops.append((reads, written))


def _hazard(loop: bool, barrier: bool) -> str | None:
  jaxlib = _compat.jaxlib_text()
  if loop and _JAXLIB >= (0, 12):
    return (f"it holds a loop, whose counter is a constant, and XLA of "
            f"jaxlib {jaxlib} crashes compiling a constant inside a stream "
            "call")
  if loop and _JAXLIB >= (0, 11):
    return (f"it holds a loop, and XLA of jaxlib {jaxlib} fails to compile "
            "the asynchronous slices of a loop's operands inside a stream "
            "call")
  if barrier and _JAXLIB >= (0, 12):
    return (f"it holds jax.checkpoint or an optimization barrier, and XLA "
            f"of jaxlib {jaxlib} cannot compile an optimization barrier "
            "inside a stream call ('Unsupported instruction opcode: "
            "opt-barrier')")
  return None


def _is_barrier(eqn) -> bool:
  return eqn.primitive.name == BARRIER or (
      eqn.primitive.name == REMAT and eqn.params.get("prevent_cse", False))


def without_cse_barriers(eqns) -> list:
  """``eqns`` with each top-level ``jax.checkpoint`` equation's
  ``prevent_cse`` off. Inside a loop's body that changes nothing that runs:
  XLA cannot merge a step's recomputation with work of another step, which
  is why jax's own documentation calls ``prevent_cse=False`` safe under
  ``lax.scan``; and it keeps the barriers out of a stream call."""
  return [eqn.replace(params={**eqn.params, "prevent_cse": False})
          if eqn.primitive.name == REMAT and eqn.params.get("prevent_cse")
          else eqn for eqn in eqns]
