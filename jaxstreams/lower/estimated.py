"""Choosing a way by the step-time estimate, where nothing can time it.

On a GPU the first calls of a ``jaxstreams.jit`` function time the
candidate ways (``jaxstreams.lower.choose``). Where nothing can (no GPU in
this process; or ``jaxstreams_autotune`` off), the default weighs them by
their estimated steps on a GPU (``jaxstreams.xla.step_time``), where there
is one to estimate for (``target_for``; ``jaxstreams_estimate_target``,
``auto`` by default): the target a call's arguments are placed on
(``gpu_target(...).abstract``: lowering for a GPU from a machine without
one), this GPU if it is an H100 or H200 (the estimate's constants are
fitted to H100 runs), or the GPU the option names. A call on CPU has
none: its program is ``jax.jit``'s whatever the way, and the plan keeps the
structural default (``gpu.default_top_level``).

By default the estimate weighs only the structural way against
``jax.jit``'s program (``inline``): it is held to H100 runs of those
programs and CONCURRENT graphs, while what it says of the loops and of
jaxlib 0.12's forked stream calls follows from fitted costs no run of
them checked; so it may step back to ``jax.jit``'s program, never pick a
way the structural rule left out. A GPU named by the option has every
candidate weighed. The ways weighed are compiled for the target in one
child process (``jaxstreams.xla.xla_graphs_of``, kept for the process:
seconds per way) once per signature and target, and the decision is kept
on disk with the timed ones (``timing.store``, keyed by the program, the
target, the ways and the estimate's own version): a returning user's
compile asks nothing more. Of those weighed, the way with the lowest
estimated step is kept, unless it is not estimated
faster than ``jax.jit``'s program (``inline``) by ``timing.MIN_GAIN``, more
for a way that needs more device memory (``timing.required_gain``, XLA's
memory analysis of the same compiles). The plan says the way was
estimated, not timed, with each way's estimate and bound. The estimate
weighs what the structural rule cannot: launches against overlap (a loop
body kept out of the graph and launched kernel by kernel, a stream call's
events per loop step), and which of host and device bounds the step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Hashable, Sequence

import jax

from jaxstreams import config
from jaxstreams.lower import gpu, timing

OPTION = "jaxstreams_estimate_target"


class EstimateFailed(RuntimeError):
  """The ways could not be compiled or estimated for the target: the
  structural default runs, and the plan says why."""


@dataclasses.dataclass(frozen=True)
class Target:
  """A GPU to estimate for: ``target`` as ``xla_graphs_of`` takes it (a
  name, a file, or a ``GpuTarget``), its name, how it was found, and
  whether every candidate way is weighed (``_weighed``)."""
  target: object
  name: str
  found: str
  every_way: bool = False


def target_for(device) -> Target | None:
  """The GPU to estimate for where nothing times the ways of a call on
  ``device`` (the option; see the module docstring), None where there is
  none or the ways are timed."""
  value = config.read(OPTION)
  if value.lower() == "none" or (config.read("jaxstreams_autotune")
                                 and jax.default_backend() == "gpu"):
    return None
  if value.lower() != "auto":
    return Target(value, value, "jaxstreams_estimate_target", every_way=True)
  if not gpu.is_gpu(device.platform):
    return None
  from jaxstreams.xla import target as targets
  placed = targets.placed_on(device)
  if placed is not None:
    return Target(placed, placed.name, "the target the arguments are on")
  kind = device.device_kind.lower()
  for name in config.ESTIMATE_TARGETS:
    if name in kind:
      return Target(name, name, "this GPU's kind, jaxstreams_autotune off")
  return None


def estimate_ways(lower: Callable[[gpu.Way], object], ways: Sequence[gpu.Way],
                  target: object) -> dict:
  """Way name -> (``StepEstimate``, bytes a call needs on the device by
  XLA's memory analysis, or None) of each of ``ways`` for ``target`` (as
  ``xla_graphs_of`` takes it); ``lower(way)``: the way's top-level program
  lowered for CUDA."""
  from jaxstreams.xla.graph import xla_graphs_of
  views = xla_graphs_of({way.name: lower(way) for way in ways},
                        target=target)
  failed = [view for view in views.values() if isinstance(view, Exception)]
  if failed:
    raise failed[0]
  return {name: (view.estimate, view.memory.needed if view.memory else None)
          for name, view in views.items()}


def choose(estimates: dict, where: str,
           memory: dict | None = None) -> tuple[str, str]:
  """The way to run and why (``where``: the target, as the reason names
  it): the lowest estimated step among the ways estimated faster than
  ``inline`` by the gain their memory asks (``timing.required_gain``;
  ``memory``: way -> bytes a call needs, where known: ``timing.MIN_GAIN``
  without a figure), else ``inline``."""
  memory = memory or {}
  baseline = estimates.get("inline")
  listed = "; ".join(
      f"{w} {e.step * 1e6:.0f} us ({e.bound}-bound)"
      for w, e in sorted(estimates.items(), key=lambda item: item[1].step))
  how = f"estimated for {where}, not timed: {listed}"
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


def estimator(owner, key: Hashable | None, args, kwargs, device,
              cache: dict) -> Callable | None:
  """Where nothing will time the ways of a call of ``owner`` (a
  ``jaxstreams.jit`` function) with these arguments, on ``device``, and
  there is a GPU to estimate for (``target_for``): ``(ways, default) ->
  (way, why)``, the ways it weighs (``_weighed``; None where that leaves
  one) compiled for that GPU and chosen by their estimated steps, once per
  signature ``key`` and target (kept in ``cache``, and on disk; a failure
  raises ``EstimateFailed``, once too). Else None."""
  found_target = target_for(device)
  if found_target is None:
    return None
  where = f"{found_target.name} ({found_target.found}" + (
      ")" if found_target.every_way
      else "; the structural way against 'inline')")

  def lower(way):
    jitted = owner._jit(way, top_level=True,
                        plan=owner.options_plan(way, args, kwargs))
    return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))

  def choose_by_estimate(ways, default: gpu.Way):
    weighed = _weighed(ways, default, found_target)
    if len(weighed) < 2:
      return None
    at = None if key is None else (key, where, tuple(weighed))
    found = cache.get(at)
    if found is None:
      try:
        found = _kept_or_estimated(lower, weighed, found_target, where,
                                   owner._streams)
      except Exception as error:  # noqa: BLE001 - the structural default runs
        found = EstimateFailed(f"the estimate for {found_target.name} failed: "
                               f"{type(error).__name__}: {str(error)[:300]}")
      if at is not None:
        cache[at] = found
    if isinstance(found, EstimateFailed):
      raise found
    return found
  return choose_by_estimate


def _weighed(ways: Sequence[gpu.Way], default: gpu.Way,
             found_target: Target) -> list[gpu.Way]:
  """The ways the estimate weighs: every candidate for a GPU the option
  names; by default only the structural way against ``inline`` (why: the
  module docstring)."""
  if found_target.every_way:
    return list(ways)
  return list(dict.fromkeys([gpu.WAYS["inline"], default]))


def _kept_or_estimated(lower, ways, found_target: Target, where: str,
                       streams: int) -> tuple[str, str]:
  """The decision kept on disk for this program, target, candidates and
  estimate (the fitted constants and the code that applies them), else the
  ways estimated now (and the decision kept)."""
  from jaxstreams.xla.graph import estimate_version, target_text
  _, config_text = target_text(found_target.target)
  disk_key = timing.cache_key(
      lower(gpu.WAYS["inline"]).as_text(),
      f"estimated for {hashlib.sha256(config_text.encode()).hexdigest()[:16]}"
      f" by {estimate_version()}", streams, [w.name for w in ways])
  kept = timing.load(disk_key)
  if kept is not None and kept.way in {w.name for w in ways}:
    return kept.way, kept.reason + " (decided earlier, kept on disk)"
  found = estimate_ways(lower, ways, found_target.target)
  way, why = choose({w: e for w, (e, _) in found.items()}, where,
                    {w: m for w, (_, m) in found.items()})
  timing.store(disk_key, timing.Decision(way, why))
  return way, why
