"""Reading the tags back off a traced program.

``effective_tag`` decides which ``stream()`` / ``colocate_with()`` block an
equation belongs to from its name stack; ``any_equation`` is the one walk
into equations' sub-jaxprs (``sub_jaxprs`` finds them, for every stage),
for tags here and for ``stage()`` markers and callbacks in staging.
``expose_tags`` rewrites a traced program so that every tag is visible at its
top level: nested ``jax.jit`` calls whose bodies hold tags are inlined (XLA
inlines them anyway, so the result is the same program), and the colocate
anchors are taken out and returned separately. The result, an
``ExposedProgram``, carries the def-use index the later stages read.

Scans that could run as one loop (``partition.loops``) must be at the top
level too. Where the program holds two or more, the wrappers users write
around them are inlined: nested jits (flax's ``nn.jit`` and equinox's
``filter_jit`` are built on jax.jit), ``jax.checkpoint`` and ``custom_jvp`` /
``custom_vjp`` functions. Run, each of those is its body; a checkpoint in
the backward pass also puts its operands through an optimization barrier,
as jax's lowering does (so that XLA does not merge the recomputation with
the forward pass), and so does its inlined form. What they mean to jax's
differentiation is kept apart: the program, differentiated, is
differentiated as traced (``ExposedProgram.differentiate_as``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jcore

from jaxstreams import _compat
from jaxstreams.tag.scopes import colocate_anchor_p, parse_scope


@dataclasses.dataclass(frozen=True)
class Tag:
  """The placement an equation asked for."""
  kind: str          # "stream" or "colocate"
  value: int         # the stream id, or the colocate token
  via_grad: bool     # the equation is a backward-pass copy of a tagged one


def effective_tag(stack: Sequence[tuple[str, str]]) -> Tag | None:
  """The innermost jaxstreams scope that applies to an equation with ``stack``.

  A ``transpose`` transform outside a scope means the equation was derived by
  ``jax.grad`` from an equation inside that scope; scopes opened with
  ``include_grad=False`` do not apply to such equations.
  """
  transposed = False
  tag = None
  for kind, name in _without_repeated_context(stack):
    if kind == "transform":
      transposed = transposed or name == "transpose"
      continue
    parsed = parse_scope(name)
    if parsed is None:
      continue
    scope_kind, value, include_grad = parsed
    if transposed and not include_grad:
      continue
    tag = Tag(scope_kind, value, transposed)
  return tag


def _without_repeated_context(stack):
  """``stack`` with the context that ``jax.grad`` repeats after a transpose
  dropped.

  For ``custom_vjp``, ``custom_jvp`` and ``jax.checkpoint``, the backward
  equations get the whole name stack of the forward ones after the
  ``transpose`` transform, context included:
  ``A/B/transpose(jvp(A/B/jvp(..)))``. The repeated ``A/B`` is the same
  blocks again, not blocks inside the transposed code, so it must not count
  as a second, derived placement. Transforms in between are kept.
  """
  stack = list(stack)
  for index, (kind, name) in enumerate(stack):
    if kind != "transform" or name != "transpose":
      continue
    context = [entry for entry in stack[:index] if entry[0] == "scope"]
    if not context:
      continue
    after = stack[index + 1:]
    kept, matched = [], 0
    for position, entry in enumerate(after):
      if matched == len(context):
        rest = _without_repeated_context(after[position:])
        return stack[:index + 1] + kept + rest
      if entry[0] == "transform":
        kept.append(entry)
      elif entry == context[matched]:
        matched += 1
      else:
        break
    else:
      if matched == len(context):
        return stack[:index + 1] + kept
  return stack


_HAS_SUBJAXPRS: dict[Any, bool] = {}


def sub_jaxprs(eqn) -> list:
  """The jaxprs in ``eqn``'s parameters (loop bodies, branches, calls).

  Whether a primitive takes jaxpr parameters does not change from one
  equation to the next, so primitives found to have none are remembered and
  skipped: the generic scan of parameters is a large share of planning time.
  """
  known = _HAS_SUBJAXPRS.get(eqn.primitive)
  if known is False:
    return []
  found = list(jcore.jaxprs_in_params(eqn.params))
  if known is None:
    _HAS_SUBJAXPRS[eqn.primitive] = bool(found) or any(
        isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr, tuple, list))
        for v in eqn.params.values())
  return found


def any_equation(eqns, predicate: Callable[[Any], bool]) -> bool:
  """Whether ``predicate`` holds for one of ``eqns`` or for an equation at
  any depth inside them (loop bodies, branches, nested calls)."""
  for eqn in eqns:
    if predicate(eqn):
      return True
    for sub in sub_jaxprs(eqn):
      if any_equation(sub.eqns, predicate):
        return True
  return False


def primitives(eqns) -> frozenset[str]:
  """The names of the primitives ``eqns`` bind, at any depth inside them."""
  found: set[str] = set()
  todo = list(eqns)
  while todo:
    eqn = todo.pop()
    found.add(eqn.primitive.name)
    for sub in sub_jaxprs(eqn):
      todo.extend(sub.eqns)
  return frozenset(found)


def has_tags(jaxpr) -> bool:
  """Whether any equation in ``jaxpr`` (closed or not; at any depth) is
  tagged."""
  return any_equation(jaxpr.eqns, _is_tagged)


def _is_tagged(eqn) -> bool:
  return eqn.primitive is colocate_anchor_p or any(
      kind == "scope" and parse_scope(name) is not None
      for kind, name in _compat.name_stack_entries(eqn))


def stream_ids(jaxpr, outer_stack=()) -> set[int]:
  """The stream ids that ``stream()`` blocks ask for anywhere in ``jaxpr``."""
  found = set()
  for eqn in jaxpr.eqns:
    stack = tuple(outer_stack) + _compat.name_stack_entries(eqn)
    tag = effective_tag(stack)
    if tag is not None and tag.kind == "stream":
      found.add(tag.value)
    for sub in sub_jaxprs(eqn):
      found |= stream_ids(sub, stack)
  return found


@dataclasses.dataclass
class ExposedProgram:
  """A traced program with its tags at the top level, and its def-use index.

  The index: ``producer`` maps each value an equation makes to that
  equation's position in ``jaxpr.eqns``; ``sources[i]`` holds the positions
  of the equations whose values equation ``i`` reads, in the order of its
  inputs (repeats kept). Assignment, partition and the schedule estimate all
  need it, in their inner loops: it is built once, with the program, and
  here is the one place that knows literals have no producer."""
  jaxpr: Any                    # jax.extend.core.Jaxpr
  consts: list[Any]
  anchors: dict[int, Any]       # colocate token -> the atom it anchors
  # The program as traced, where inlining took a jax.checkpoint or a
  # custom_jvp/custom_vjp function apart: jax differentiates it instead of
  # this one (lowering sees to it), so that each keeps its meaning there.
  differentiate_as: Any = None
  producer: dict[Any, int] = dataclasses.field(init=False, repr=False)
  sources: list[tuple[int, ...]] = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    self.producer, self.sources = {}, []
    for index, eqn in enumerate(self.jaxpr.eqns):
      self.sources.append(tuple(
          self.producer[v] for v in eqn.invars
          if not isinstance(v, jcore.Literal) and v in self.producer))
      for var in eqn.outvars:
        self.producer[var] = index

  def producer_of(self, atom) -> int | None:
    """The position of the equation that makes ``atom``; None for a
    literal, an argument or a constant."""
    return None if isinstance(atom, jcore.Literal) else self.producer.get(atom)


def expose_tags(closed_jaxpr) -> ExposedProgram:
  jaxpr = closed_jaxpr.jaxpr
  group = _scans_within(jaxpr.eqns, derivatives=True) >= 2
  builder = _Builder(list(jaxpr.constvars), list(closed_jaxpr.consts),
                     inline_calls=group,
                     inline_derivatives=group and not jaxpr.effects)
  builder.add_eqns(jaxpr.eqns, outer=None)
  outvars = [builder.read(v) for v in jaxpr.outvars]
  new_jaxpr = _compat.make_jaxpr(jaxpr.invars, outvars, builder.eqns,
                                 constvars=builder.constvars,
                                 consts=builder.consts)
  return ExposedProgram(
      new_jaxpr, builder.consts, builder.anchors,
      differentiate_as=closed_jaxpr if builder.took_derivatives_apart
      else None)


# The loops partition groups (partition.loops).
_SCAN = "scan"


@functools.cache
def _barrier_primitive():
  return (jax.make_jaxpr(jax.lax.optimization_barrier)(1.0)
          .jaxpr.eqns[0].primitive)


def _wrapped(eqn, derivatives: bool):
  """The closed jaxpr a wrapper equation runs, if it is one that inlining
  may take apart: a plain nested jit or call, and with ``derivatives`` a
  checkpoint or custom_jvp / custom_vjp function; else None."""
  name = eqn.primitive.name
  if name in _compat.NESTED_JIT_PRIMITIVES:
    if not _compat.jit_params_are_plain(eqn.params):
      return None
  elif not (derivatives and name in _compat.DERIVATIVE_WRAPPERS):
    return None
  return _compat.nested_jaxpr(eqn.params)


def _scans_within(eqns, derivatives: bool) -> int:
  """The scans in ``eqns`` or inside the wrappers among them that inlining
  would bring to the top level."""
  count = 0
  for eqn in eqns:
    if eqn.primitive.name == _SCAN:
      count += 1
      continue
    inner = _wrapped(eqn, derivatives)
    if inner is not None:
      count += _scans_within(inner.jaxpr.eqns, derivatives)
  return count


class _Builder:
  """Accumulates equations while inlining nested jits that hold tags, and
  with ``inline_calls`` / ``inline_derivatives`` the wrappers (nested jits
  and calls / checkpoints and custom derivatives) that hold scans."""

  def __init__(self, constvars, consts, inline_calls: bool = False,
               inline_derivatives: bool = False):
    self.constvars = constvars
    self.consts = consts
    self.eqns: list[Any] = []
    self.anchors: dict[int, Any] = {}
    self._subst: dict[Any, Any] = {}
    self.inline_calls = inline_calls
    self.inline_derivatives = inline_derivatives
    self.took_derivatives_apart = False

  def read(self, atom):
    if isinstance(atom, jcore.Literal):
      return atom
    return self._subst.get(atom, atom)

  def add_eqns(self, eqns, outer) -> None:
    for eqn in eqns:
      eqn = eqn.replace(invars=[self.read(v) for v in eqn.invars])
      if outer is not None:
        eqn = _compat.with_outer_name_stack(eqn, outer)
      if eqn.primitive is colocate_anchor_p:
        self.anchors[eqn.params["token"]] = eqn.invars[0]
        self._subst[eqn.outvars[0]] = eqn.invars[0]
        continue
      if self._should_inline(eqn):
        self._inline(eqn)
        continue
      self.eqns.append(eqn)

  def _should_inline(self, eqn) -> bool:
    inner = _wrapped(eqn, self.inline_derivatives)
    if inner is None:
      return False
    if (eqn.primitive.name in _compat.NESTED_JIT_PRIMITIVES
        and has_tags(inner)):
      return True
    return ((self.inline_calls or self.inline_derivatives)
            and _scans_within(inner.jaxpr.eqns, self.inline_derivatives) > 0)

  def _inline(self, eqn) -> None:
    inner = _compat.nested_jaxpr(eqn.params)
    for var, const in zip(inner.jaxpr.constvars, inner.consts):
      fresh = _compat.new_var(var.aval)
      self.constvars.append(fresh)
      self.consts.append(const)
      self._subst[var] = fresh
    operands = list(eqn.invars)
    if eqn.primitive.name in _compat.DERIVATIVE_WRAPPERS:
      self.took_derivatives_apart = True
    if eqn.primitive.name == _compat.CHECKPOINT_PRIMITIVE:
      operands = self._behind_barrier(eqn, operands)
    for var, atom in zip(inner.jaxpr.invars, operands):
      self._subst[var] = atom
    # The same inner jaxpr may be inlined twice: give its results fresh names.
    renamed = []
    for inner_eqn in inner.jaxpr.eqns:
      outvars = []
      for var in inner_eqn.outvars:
        if isinstance(var, jcore.DropVar):
          outvars.append(var)
        else:
          fresh = _compat.new_var(var.aval)
          self._subst[var] = fresh
          outvars.append(fresh)
      renamed.append((inner_eqn, outvars))
    for inner_eqn, outvars in renamed:
      self.add_eqns([inner_eqn.replace(outvars=outvars)], outer=eqn)
    for outer_var, inner_atom in zip(eqn.outvars, inner.jaxpr.outvars):
      if not isinstance(outer_var, jcore.DropVar):
        self._subst[outer_var] = self.read(inner_atom)

  def _behind_barrier(self, eqn, operands: list) -> list:
    """``operands`` of a checkpoint equation, those jax lowers through an
    optimization barrier passed through one (``eqn`` carries its name
    stack already)."""
    flags = _compat.checkpoint_barrier_operands(eqn)
    held = [v for v, flag in zip(operands, flags)
            if flag and not isinstance(v, jcore.Literal)]
    if not held:
      return operands
    passed = [_compat.new_var(v.aval) for v in held]
    self.eqns.append(jcore.new_jaxpr_eqn(held, passed, _barrier_primitive(),
                                         {}, set(), eqn.source_info))
    through = dict(zip(held, passed))
    return [through.get(v, v) if not isinstance(v, jcore.Literal) else v
            for v in operands]
