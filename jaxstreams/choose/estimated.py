"""Choosing a way by the step-time estimate, where nothing can time it.

On a GPU the first calls of a ``jaxstreams.jit`` function time the
candidate ways (``jaxstreams.choose.choice``). Where nothing can (no GPU in
this process; or ``jaxstreams_autotune`` off), the default weighs them by
their estimated steps on a GPU (``jaxstreams.xla.step_time``), where there
is one to estimate for (``target_for``; ``jaxstreams_estimate_target``,
``auto`` by default): the target a call's arguments are placed on
(``gpu_target(...).abstract``: lowering for a GPU from a machine without
one), this GPU if it is an H100 or H200 (the estimate's constants are
fitted to H100 runs), or the GPU the option names. A call on CPU has
none: its program is ``jax.jit``'s whatever the way, and the plan keeps the
structural default (``gpu.default_top_level``).

The estimate decides only where it predicts. Held out (each H100 model
estimated by constants fitted without it), its ratio of a way to
``jax.jit``'s misses by tens of percent (``fitted_costs.HELD_OUT``, per
way; ``benchmarks/results/h100/jax*/step_time_held_out_*``), and the H100
ran ``jax.jit`` + CONCURRENT at 0.98x-2.2x of ``jax.jit`` in every run of
its six models: stepping back from the structural way risks up to 2x,
keeping it lost at most 2%. So (``choose``) the structural way
(``gpu.default_top_level``) stands unless

* another way is estimated faster than it by more than the held-out error
  of both (the measured speed-up lies above 1 whatever the error), where
  neither way's held-out error passes ``DECIDES_WITHIN`` (20%): a tie
  keeps the structural way, and so does an estimate that was off by more
  (CONCURRENT's was, on the chains and the Inception-style step: its
  figures are shown, with why they do not decide);
* the structural way would not fit in the device's memory, or needs more
  than ``inline`` by ``MEMORY_SHARE`` of the device's memory.

A kind of program no GPU run has measured (loops side by side, jaxlib
0.12's forked stream calls: ``held_out_range`` None) is extrapolated: its
estimate is shown, never acted on. By default only the structural way is
weighed against ``jax.jit``'s program (``inline``); a GPU named by the
option has every candidate weighed by the same rule. The ways weighed are
compiled for the target in one child process
(``jaxstreams.xla.xla_graphs_of``, kept for the process: seconds per way)
once per signature and target, and the decision is kept on disk with the
timed ones (``timing.store``, keyed by the program, the target, the ways
and the estimate's own version, ``estimate_version``): a returning
user's compile asks nothing more. The plan says the way was estimated, not
timed, with each way's estimate (and how far a step's figure was off held
out, ``fitted_costs.STEP_HELD_OUT``), its bound and its speed against the
structural way within the held-out error (or "extrapolated"), and the rule
that decided.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import re
from typing import Callable, Hashable, Sequence

import jax

from jaxstreams import _compat, config
from jaxstreams.choose import timing
from jaxstreams.lower import gpu

OPTION = "jaxstreams_estimate_target"
# A way needing more device memory than ``inline`` by this share of the
# device's memory is vetoed: a real share of the device, not a ratio of a
# few MiB of temporaries.
MEMORY_SHARE = 0.1
# The estimate decides between two ways only where, held out (each H100
# model estimated by constants fitted without it), neither way's figure was
# off by more than this share: past it, its figures are shown, never acted
# on.
DECIDES_WITHIN = 0.2


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


def held_out_range(way: str) -> tuple[float, float] | None:
  """The lowest and highest held-out error of ``way``'s estimated ratio to
  ``jax.jit``'s (``fitted_costs.HELD_OUT``), or None where no GPU run
  measured its kind of program on this jax: the loops' ways, and stream
  calls where jaxlib 0.12 forks them in its graphs (extrapolated)."""
  from jaxstreams import _compat
  from jaxstreams.xla import fitted_costs
  if way.startswith("streams") and _compat.XLA_SCHEDULES_STREAM_CALLS:
    return None
  return fitted_costs.HELD_OUT.get(way)


def beyond_reach(way: str) -> str:
  """Why the estimate of ``way`` does not decide ("" where it may): no GPU
  run measured its kind of program (extrapolated), or, held out, its figure
  was off by more than ``DECIDES_WITHIN`` on some H100 model."""
  errors = held_out_range(way)
  if errors is None:
    return "extrapolated"
  worst = max(errors, key=abs)
  if abs(worst) > DECIDES_WITHIN:
    return (f"held out, off by up to {worst:+.0%} (beyond the "
            f"{DECIDES_WITHIN:.0%} within which the estimate decides)")
  return ""


def speedup(estimates: dict, way: str,
            over: str) -> tuple[float, float, float] | None:
  """``way``'s estimated speed over ``over``'s (``over``'s step over
  ``way``'s), and the least and most it may be given both ways' held-out
  errors; None where the estimate of either does not decide
  (``beyond_reach``)."""
  if beyond_reach(way) or beyond_reach(over):
    return None
  errors, against = held_out_range(way), held_out_range(over)
  ratio = estimates[over].step / estimates[way].step
  return (ratio, ratio * (1 + against[0]) / (1 + errors[1]),
          ratio * (1 + against[1]) / (1 + errors[0]))


def memory_veto(way: str, memory: dict, device_memory: int | None) -> str:
  """Why ``way`` is vetoed by its memory ("" where it is not): it would not
  fit in the device's ``device_memory`` bytes, or it needs more than
  ``inline`` by ``MEMORY_SHARE`` of them (``memory``: way -> bytes a call
  needs, XLA's memory analysis). No figure, no veto."""
  needed = memory.get(way)
  if not needed or not device_memory:
    return ""
  if needed > device_memory:
    return (f"{way!r} needs {needed / 2**30:.1f} GiB, more than the "
            f"device's {device_memory / 2**30:.0f} GiB")
  extra = needed - (memory.get("inline") or needed)
  if extra > MEMORY_SHARE * device_memory:
    return (f"{way!r} needs {extra / 2**30:.1f} GiB more than 'inline', "
            f"{extra / device_memory:.0%} of the device's memory (the rule: "
            f"{MEMORY_SHARE:.0%})")
  return ""


def choose(estimates: dict, default: str, where: str,
           memory: dict | None = None,
           device_memory: int | None = None) -> tuple[str, str]:
  """The way to run and why, by the estimates (way -> ``StepEstimate``)
  for ``where`` (the target, as the reason names it): the structural way
  ``default`` unless its memory vetoes it (``memory_veto``; then
  ``inline``) or another way is estimated faster than it by more than the
  held-out error of both (``speedup``; the fastest such). The reason names
  the rule that decided and gives each way's step and bound, and its
  speed against ``default`` within the held-out error, or
  "extrapolated"."""
  memory = memory or {}

  def figure(way):
    estimate = estimates[way]
    text = f"{way} {estimate.step * 1e6:.0f} us ({estimate.bound}-bound"
    if way == default:
      return text + (f", {beyond_reach(way)})" if beyond_reach(way) else ")")
    found = speedup(estimates, way, default)
    if found is None:
      return text + (f", {estimates[default].step / estimate.step:.2f}x "
                     f"{default!r}'s speed, "
                     f"{beyond_reach(way) or beyond_reach(default)})")
    return text + (f", {found[0]:.2f}x {default!r}'s speed, "
                   f"{found[1]:.2f}-{found[2]:.2f}x within the held-out error)")
  listed = "; ".join(figure(w) for w in sorted(
      estimates, key=lambda w: estimates[w].step))
  from jaxstreams.xla import fitted_costs
  low, high = fitted_costs.STEP_HELD_OUT
  how = (f"estimated for {where}, not timed (a step's figure, held out, "
         f"was {low:+.0%} to {high:+.0%} off the H100's): {listed}")
  vetoed = memory_veto(default, memory, device_memory)
  if vetoed and default != "inline":
    return "inline", (f"{how}; took 'inline' by the memory rule: {vetoed}")
  beyond = {}
  for way in estimates:
    found = None if way == default else speedup(estimates, way, default)
    if (found is not None and found[1] > 1
        and not memory_veto(way, memory, device_memory)):
      beyond[way] = found
  if beyond:
    way = max(beyond, key=lambda w: beyond[w][0])
    ratio, low, high = beyond[way]
    return way, (f"{how}; took {way!r}: estimated {ratio:.2f}x the "
                 f"structural way's speed, {low:.2f}-{high:.2f}x within "
                 "the held-out error (the rule: another way only where its "
                 "gain is beyond the estimate's held-out error)")
  if held_out_range(default) is None:
    rule = ("no GPU run has measured its kind of program, so its estimate "
            "is extrapolated and does not decide")
  elif beyond_reach(default) or all(
      beyond_reach(w) for w in estimates if w != default):
    rule = ("held out, the estimate was off by more than "
            f"{DECIDES_WITHIN:.0%} for these ways, so it does not decide")
  else:
    rule = ("no other way is estimated faster by more than the estimate's "
            "held-out error (the rule: the structural way stands within "
            "it; a tie keeps it)")
  return default, f"{how}; kept the structural way {default!r}: {rule}"


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
        found = _kept_or_estimated(lower, weighed, default.name,
                                   found_target, where, owner._streams)
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


# What an estimated decision comes from besides the program and the target:
# the code that reads XLA's output into launches and work, the play, the
# fitted constants and held-out errors, and the rule that weighs them.
ESTIMATE_MODULES = ("jaxstreams.xla.graph", "jaxstreams.xla.xla_logs",
                    "jaxstreams.xla.schedule", "jaxstreams.xla.launches",
                    "jaxstreams.xla.work", "jaxstreams.xla.step_time",
                    "jaxstreams.xla.fitted_costs",
                    "jaxstreams.choose.estimated")


def estimate_version() -> str:
  """A digest of everything an estimated decision depends on besides the
  program and the target (``ESTIMATE_MODULES``' sources, and whether
  jaxlib forks stream calls, which makes them extrapolated): a decision
  kept on disk from another is stale."""
  digest = hashlib.sha256(
      f"forks stream calls: {_compat.XLA_SCHEDULES_STREAM_CALLS}".encode())
  for name in ESTIMATE_MODULES:
    with open(importlib.util.find_spec(name).origin, "rb") as source:
      digest.update(source.read())
  return digest.hexdigest()[:16]


def _kept_or_estimated(lower, ways, default: str, found_target: Target,
                       where: str, streams: int) -> tuple[str, str]:
  """The decision kept on disk for this program, target, candidates and
  estimate (the fitted constants and the code that applies them), else the
  ways estimated now (and the decision kept)."""
  from jaxstreams.xla.graph import target_text
  _, config_text = target_text(found_target.target)
  disk_key = timing.cache_key(
      lower(gpu.WAYS["inline"]).as_text(),
      f"estimated for {hashlib.sha256(config_text.encode()).hexdigest()[:16]}"
      f" by {estimate_version()}, structural {default}", streams,
      [w.name for w in ways])
  kept = timing.load(disk_key)
  if kept is not None and kept.way in {w.name for w in ways}:
    return kept.way, kept.reason + " (decided earlier, kept on disk)"
  found = estimate_ways(lower, ways, found_target.target)
  size = re.search(r"device_memory_size:\s*(\d+)", config_text)
  way, why = choose({w: e for w, (e, _) in found.items()}, default, where,
                    {w: m for w, (_, m) in found.items()},
                    int(size.group(1)) if size else None)
  timing.store(disk_key, timing.Decision(way, why))
  return way, why
