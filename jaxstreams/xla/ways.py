"""Every way of a ``jaxstreams.jit`` function, compiled for a GPU target:
what each needs on the device against ``jax.jit``'s program, and what the
GPU launches for it (``f.plan(*args, target="h100")``).

Each way is lowered here, for CUDA, as a call at top level would run it
(its compiler options included), and the way a call traced inside another
jit runs is lowered as its own program, without options; all of them
compile one after the other in one child process (``xla_graphs_of``: XLA's
command-buffer log needs a process of its own), which returns XLA's
memory analysis and the view of each (with its estimated step,
``jaxstreams.xla.step_time``). No GPU needed: the figures are those
of XLA's compiler for the target, which allocates what its analysis says
(without a device it does not autotune, so a GPU's own compile can pick
other GEMM algorithms and workspaces).
"""

from __future__ import annotations

from typing import Any

from jaxstreams.lower import gpu
from jaxstreams.lower.memory import WayMemory, WaysMemory
from jaxstreams.xla.graph import GraphLogError, xla_graphs_of


def ways_of(fn, plan) -> list[tuple[gpu.Way, bool]]:
  """The programs the report states for ``fn`` (a ``StreamJit``) and its
  ``plan``: jax.jit's (``inline``), the top-level ways a GPU would time (or
  the way asked for), and the way of calls inside another jit, as
  ``(way, nested)``."""
  lowering = fn._spec.lowering()
  top = (gpu.candidates(plan) if lowering == gpu.DEFAULT
         else (gpu.WAYS["inline"], gpu.WAYS[lowering]))
  found = [(w, False) for w in dict.fromkeys(top)]
  found.append((fn._nested_way(), True))
  return found


def state_ways(fn, plan, args, kwargs, target: Any = "h100",
               timeout: float = 1200) -> WaysMemory:
  """Compile every way of ``fn`` for these arguments for ``target`` (see
  ``jaxstreams.xla_graphs``) and state what each needs on the device."""
  from jaxstreams.xla import target as targets
  name = (target.name if isinstance(target, targets.GpuTarget)
          else "this machine's GPU" if target == "local"
          else targets.target_config(target)[0])
  lowered, notes = {}, {}
  for way, nested in ways_of(fn, plan):
    key = _key(way, nested)
    try:
      jitted = (fn._jit(way, top_level=False) if nested else
                fn._jit(way, top_level=True,
                        plan=fn.options_plan(way, args, kwargs)))
      lowered[key] = jitted.trace(*args, **kwargs).lower(
          lowering_platforms=("cuda",))
    except Exception as error:  # noqa: BLE001 - a way that cannot lower
      notes[key] = f"did not lower: {type(error).__name__}: {error}"[:300]
  views = xla_graphs_of(lowered, target=target,
                        plans={k: plan for k in lowered},
                        timeout=timeout) if lowered else {}
  stated = []
  for way, nested in ways_of(fn, plan):
    key = _key(way, nested)
    view = views.get(key)
    if isinstance(view, GraphLogError):
      notes[key] = str(view)[:300]
      view = None
    stated.append(WayMemory(
        way.name, nested, footprint=view.memory if view is not None else None,
        graphs=view, seconds=_step(view), note=notes.get(key, "")))
  return WaysMemory(f"XLA's memory analysis, compiled for {name}"
                    + ("" if target == "local" else " without a GPU"),
                    tuple(stated))


def _step(view) -> float | None:
  """The view's estimated step on the target (``jaxstreams.xla.step_time``),
  None without a view or where the launches cannot be estimated."""
  if view is None:
    return None
  try:
    return view.estimate.step
  except Exception:  # noqa: BLE001 - the memory is stated all the same
    return None


def _key(way: gpu.Way, nested: bool) -> str:
  return f"{way.name}{' nested' if nested else ''}"
