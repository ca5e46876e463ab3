"""Choosing a way by the step-time estimate, where nothing can time it.

On a GPU the first calls of a ``jaxstreams.jit`` function time the
candidate ways (``jaxstreams.lower.choose``). Where nothing can (no GPU in
this process: a program lowered for a target from a machine without one;
or ``jaxstreams_autotune`` off), the default is structural
(``gpu.default_top_level``) unless a target to estimate for is given
(``jaxstreams_estimate_target``): then the candidate ways are compiled for
that target in one child process (``jaxstreams.xla.xla_graphs_of``, once
per signature: seconds to minutes, compiles the user asked for by setting
the option) and the way with the lowest estimated step
(``jaxstreams.xla.step_time``) is kept, unless it is not estimated faster
than ``jax.jit``'s program (``inline``) by ``timing.MIN_GAIN``, more for a
way that needs more device memory (``timing.required_gain``, XLA's memory
analysis of the same compiles). The plan
says the way was estimated, not timed, with each way's estimate and bound.
The estimate weighs what the structural rule cannot: launches against
overlap (a loop body kept out of the graph and launched kernel by kernel,
a stream call's events per loop step), and which of host and device bounds
the step.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import jax

from jaxstreams import config
from jaxstreams.lower import gpu, timing

OPTION = "jaxstreams_estimate_target"


class EstimateFailed(RuntimeError):
  """The ways could not be compiled or estimated for the target: the
  structural default runs, and the plan says why."""


def target() -> str | None:
  """The target to estimate for (the option), None where none is set."""
  return config.read(OPTION) or None


def estimate_ways(lower: Callable[[gpu.Way], object], ways: Sequence[gpu.Way],
                  target_name: str) -> dict:
  """Way name -> (``StepEstimate``, bytes a call needs on the device by
  XLA's memory analysis, or None) of each of ``ways`` for ``target_name``;
  ``lower(way)``: the way's top-level program lowered for CUDA."""
  from jaxstreams.xla.graph import xla_graphs_of
  views = xla_graphs_of({way.name: lower(way) for way in ways},
                        target=target_name)
  failed = [view for view in views.values() if isinstance(view, Exception)]
  if failed:
    raise failed[0]
  return {name: (view.estimate, view.memory.needed if view.memory else None)
          for name, view in views.items()}


def choose(estimates: dict, target_name: str,
           memory: dict | None = None) -> tuple[str, str]:
  """The way to run and why: the lowest estimated step among the ways
  estimated faster than ``inline`` by the gain their memory asks
  (``timing.required_gain``; ``memory``: way -> bytes a call needs, where
  known: ``timing.MIN_GAIN`` without a figure), else ``inline``."""
  memory = memory or {}
  baseline = estimates.get("inline")
  listed = "; ".join(
      f"{w} {e.step * 1e6:.0f} us ({e.bound}-bound)"
      for w, e in sorted(estimates.items(), key=lambda item: item[1].step))
  how = (f"estimated for {target_name} (jaxstreams_estimate_target), not "
         f"timed: {listed}")
  ranked = sorted(estimates, key=lambda w: estimates[w].step)
  if baseline is None or ranked[0] == "inline":
    return "inline", f"{how}; kept 'inline': no way is estimated faster"
  ratio = lambda w: (memory[w] / memory["inline"]
                     if memory.get(w) and memory.get("inline") else None)
  gain = lambda w: baseline.step / estimates[w].step - 1
  for way in ranked:
    if way != "inline" and gain(way) >= timing.required_gain(ratio(way)):
      held = (f", {ratio(way):.2f}x its memory" if ratio(way) is not None
              else "")
      return way, (f"{how}; chose {way!r}: estimated {gain(way):.0%} faster "
                   f"than 'inline'{held}")
  best = ranked[0]
  more = (f" for {ratio(best):.2f}x the memory"
          if ratio(best) is not None and ratio(best) > 1 else "")
  return "inline", (f"{how}; kept 'inline': {best!r} is estimated "
                    f"{gain(best):.1%} faster (needs "
                    f"{timing.required_gain(ratio(best)):.0%}{more})")


def estimator(owner, key: Hashable | None, args, kwargs,
              cache: dict) -> Callable | None:
  """Where nothing will time the ways (no GPU in this process, or
  ``jaxstreams_autotune`` off) and a target is set: ``ways -> (way,
  why)`` for a call of ``owner`` (a ``jaxstreams.jit`` function) with
  these arguments, its ways compiled for the target and chosen by their
  estimated steps, once per signature ``key`` (kept in ``cache``; a
  failure raises ``EstimateFailed``, once too). Else None."""
  name = target()
  if name is None or (config.read("jaxstreams_autotune")
                      and jax.default_backend() == "gpu"):
    return None

  def lower(way):
    jitted = owner._jit(way, top_level=True,
                        plan=owner.options_plan(way, args, kwargs))
    return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))

  def choose_by_estimate(ways):
    found = cache.get(key)
    if found is None:
      try:
        found = estimate_ways(lower, ways, name)
        found = choose({w: e for w, (e, _) in found.items()}, name,
                       {w: m for w, (_, m) in found.items()})
      except Exception as error:  # noqa: BLE001 - the structural default runs
        found = EstimateFailed(f"the estimate for {name} failed: "
                               f"{type(error).__name__}: {str(error)[:300]}")
      if key is not None:
        cache[key] = found
    if isinstance(found, EstimateFailed):
      raise found
    return found
  return choose_by_estimate
