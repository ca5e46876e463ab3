"""Cutting a jaxpr into parts: what each part reads, makes and runs.

Three parts of the package run pieces of one traced program: partition cuts
a planned program into regions (lowering emits each as one call), staging
cuts a step into producer stages and a consumer, and serve runs a request's
whole program as one function of its constants and arguments. Given which
equations each part runs, all of them need the same answers, and this is
the one place that works them out:

* a part's *inputs*: the values its equations read that it does not make
  itself (arguments, constants, values of other parts), first read first;
* its *outputs*: the values it makes that are read outside it (by another
  part, or as the program's results), in program order;
* a function of its inputs that returns its outputs, each equation bound
  again with its name stack and source line (``part_function``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import jax.extend.core as jcore

from jaxstreams import _compat


@dataclasses.dataclass(frozen=True, eq=False)
class Part:
  """One part of a cut jaxpr."""
  equations: tuple[int, ...]   # positions in jaxpr.eqns, in program order
  inputs: tuple[Any, ...]      # values it reads and does not make
  outputs: tuple[Any, ...]     # values it makes that are read outside it


def cut(jaxpr, members: Sequence[Sequence[int]], *,
        results_part: int | None = None) -> tuple[Part, ...]:
  """``jaxpr`` cut into parts; part ``p`` runs the equations at the
  positions ``members[p]`` (in program order).

  An equation may be in several parts: each runs it, and a value that a
  part makes itself is never its input. The program's results are read by
  part ``results_part`` (those it does not make are its inputs; it returns
  the results itself, ``part_function``'s caller names them), or, with
  None, outside every part: each part then outputs the results it makes.
  """
  eqns = jaxpr.eqns
  inputs: list[dict] = []            # ordered sets
  for p, positions in enumerate(members):
    made: set = set()
    reads: dict = {}
    for i in positions:
      eqn = eqns[i]
      for v in eqn.invars:
        if not isinstance(v, jcore.Literal) and v not in made:
          reads[v] = None
      made.update(eqn.outvars)
    if p == results_part:
      for v in jaxpr.outvars:
        if not isinstance(v, jcore.Literal) and v not in made:
          reads[v] = None
    inputs.append(reads)
  read_outside = set().union(*inputs)
  if results_part is None:
    read_outside.update(v for v in jaxpr.outvars
                        if not isinstance(v, jcore.Literal))
  return tuple(
      Part(tuple(positions), tuple(reads),
           tuple(v for i in positions for v in eqns[i].outvars
                 if v in read_outside))
      for positions, reads in zip(members, inputs))


def part_jaxpr(inputs: Iterable, outputs: Iterable, eqns: Iterable
               ) -> jcore.ClosedJaxpr:
  """The closed jaxpr of ``eqns`` from ``inputs`` to ``outputs`` (any of
  the program's values, literals among the outputs too)."""
  return jcore.ClosedJaxpr(_compat.make_jaxpr(inputs, outputs, eqns), ())


def part_function(inputs: Iterable, outputs: Iterable, eqns: Iterable
                  ) -> Callable[..., list]:
  """A function of ``inputs``' values returning ``outputs``' values, that
  binds each of ``eqns`` again (with its name stack and context)."""
  return jcore.jaxpr_as_fun(part_jaxpr(inputs, outputs, eqns))
