"""What every workload shares: placements, candidates, and a case record.

A workload writes its model once against a *placement*, a function
``place(stream, fn, *args)`` that runs ``fn(*args)`` on a stream. Three
placements give the programs the suite compares:

* ``place_none``: no placement at all; the program ``jax.jit`` gets.
* ``place_jaxstreams``: ``with jaxstreams.stream(stream):`` around the call.
* ``place_compute_on``: the same placement written by hand with JAX's own
  ``compute_on`` (a call annotated ``gpu_stream:k``; stream 0 is left inline).

So the baselines run the same model with the same placement, and only the
mechanism differs.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Any, Callable

import jax
import numpy as np

import jaxstreams

CONCURRENT_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
GPU_ONLY = "n/a: needs a GPU backend"
_ANNOTATED_CALL = re.compile(
    r'= (?:func\.)?call @\S+.*?_xla_stream_annotation = "(\d+)"')


# Where the suite reads XLA's schedule of a candidate. On a GPU: from the
# compile that runs. Elsewhere: from a deviceless H100 compile made in a
# child process (suite.py, ``deviceless_schedules``), which sets this
# variable: XLA's deviceless compile of some programs needs more memory than
# the machine has (jax 0.12.0.1, the 8-tower DLRM-style training step: the
# process was killed at 24 GB), and a child that dies loses only its cell.
DEVICELESS_HERE = "JAXSTREAMS_SUITE_DEVICELESS_HERE"


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def schedules_here() -> bool:
  """Whether this process reads the schedules of the candidates it builds."""
  return on_gpu() or os.environ.get(DEVICELESS_HERE) == "1"


# ---------------------------------------------------------------------------
# Placements.

def place_none(stream: int, fn: Callable, *args):
  del stream
  return fn(*args)


def place_jaxstreams(stream: int, fn: Callable, *args):
  with jaxstreams.stream(stream):
    return fn(*args)


def compute_on_region(stream: int, fn: Callable) -> Callable:
  """``fn`` wrapped in a call that XLA:GPU runs on compute stream ``stream``.

  jax 0.10 names the function-level wrapper ``compute_on2``; 0.11 renames it
  ``compute_on`` (and drops the older per-op context manager of that name).
  """
  from jax.experimental import compute_on as co
  wrap = getattr(co, "compute_on2", None) or co.compute_on
  return wrap(compute_type=f"gpu_stream:{stream}",
              out_memory_spaces=jax.memory.Space.Device)(fn)


def place_compute_on(stream: int, fn: Callable, *args):
  if stream == 0:
    return fn(*args)
  return compute_on_region(stream, fn)(*args)


def stream_for(item: int, streams: int) -> int:
  """Item ``k`` (branch, tower, model) goes to stream ``k % streams``."""
  return item % streams


# ---------------------------------------------------------------------------
# Candidates.

@dataclasses.dataclass
class Candidate:
  """One way of running a case. ``run()`` does one timed unit of work and
  returns what to block on; ``run is None`` means not applicable here."""
  name: str
  run: Callable[[], Any] | None = None
  status: str = "ok"
  compiled: Any = None                     # a jax Compiled, for memory stats
  # stream -> calls (CUDA lowering)
  annotated_calls: dict[str, int] | None = None
  call_starts: int | None = None           # call-start ops, compiled on GPU
  scheduled: dict | str | None = None      # XLA's schedule of its regions
  cleanup: Callable[[], None] | None = None


@dataclasses.dataclass
class Case:
  workload: str
  size: dict
  candidate: str                  # the jaxstreams candidate, timed against...
  baselines: list[str]            # ...these
  candidates: dict[str, Candidate]
  reference: str = "jax.jit"      # outputs are compared against this one
  notes: str = ""
  # What the candidate chose while it was timed (a mode="measured"
  # decision), read once the timing is done; None where it chooses nothing.
  chose: Callable[[], dict] | None = None

  def close(self):
    for c in self.candidates.values():
      if c.cleanup is not None:
        c.cleanup()
    self.candidates.clear()


def not_applicable(name: str, why: str = GPU_ONLY) -> Candidate:
  return Candidate(name=name, run=None, status=why)


def _short(exc: BaseException) -> str:
  text = str(exc).strip().splitlines()
  return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def annotated_calls(jitted, args) -> dict[str, int] | None:
  """Calls annotated with a stream in the program lowered for CUDA (this works
  on any machine), counted by stream; None when lowering for CUDA fails.
  Every function of the module counts: jaxstreams emits a group of loops as
  one loop whose body (a function of its own) calls each tower's body on
  its stream. A compute_on body repeats the annotation on the calls nested
  in it, so its counts are not calls made at top level; which streams are
  used is what compares."""
  try:
    text = jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  except Exception:  # noqa: BLE001 - a missing count is reported as null
    return None
  counts = collections.Counter(_ANNOTATED_CALL.findall(text))
  return {k: counts[k] for k in sorted(counts, key=int)}


def compiled_candidate(name: str, jitted, args, *, compiler_options=None,
                       count_annotations: bool = False) -> Candidate:
  """Lower and compile ``jitted`` for ``args``; timing calls the executable."""
  counts = annotated_calls(jitted, args) if count_annotations else None
  try:
    lowered = jitted.lower(*args)
    if compiler_options:
      compiled = lowered.compile(compiler_options=compiler_options)
    else:
      compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001 - reported in the results
    return Candidate(name=name, status=f"error: {_short(e)}",
                     annotated_calls=counts)
  starts = None
  if on_gpu():
    try:
      starts = compiled.as_text().count("call-start")
    except Exception:  # noqa: BLE001
      starts = None
  scheduled = (scheduled_overlap(jitted, args, compiled)
               if count_annotations and schedules_here() else None)
  return Candidate(name=name, run=lambda: compiled(*args), compiled=compiled,
                   annotated_calls=counts, call_starts=starts,
                   scheduled=scheduled)


def scheduled_overlap(jitted, args, compiled) -> dict | str:
  """What XLA:GPU scheduled for the program's async regions: from this
  compile on a GPU, else from a deviceless H100 compile (needs the CUDA plugin
  and JAX_PLATFORMS=cpu; see README "What XLA will run")."""
  try:
    if on_gpu():
      target = jax.devices()[0].device_kind
    else:
      target = "H100 (deviceless)"
      h100 = jaxstreams.gpu_target("h100")
      compiled = jitted.lower(*h100.abstract(*args)).compile()
    schedule = jaxstreams.xla_schedule(compiled)
  except Exception as e:  # noqa: BLE001 - reported in the results
    return f"n/a: {_short(e)}"
  return {"target": target, "regions": len(schedule.main_regions),
          "overlapped": len(schedule.overlapped),
          "peak_in_flight": schedule.peak_in_flight,
          "synchronous": len(schedule.synchronous)}


def standard_candidates(make_fn: Callable[[Callable], Callable], args,
                        streams: int) -> dict[str, Candidate]:
  """jax.jit, XLA CONCURRENT, compute_on and jaxstreams for one model.

  ``make_fn(place)`` returns the model function written with placement
  ``place``. The GPU-only baselines are marked not applicable elsewhere; the
  compute_on program is still lowered for CUDA so its annotated calls are
  counted.
  """
  gpu = on_gpu()
  cands = {}
  cands["jax.jit"] = compiled_candidate("jax.jit", jax.jit(make_fn(place_none)),
                                        args)
  if gpu:
    cands["XLA CONCURRENT"] = compiled_candidate(
        "XLA CONCURRENT", jax.jit(make_fn(place_none)), args,
        compiler_options=CONCURRENT_OPTIONS)
  else:
    cands["XLA CONCURRENT"] = not_applicable("XLA CONCURRENT")
  hand = jax.jit(make_fn(place_compute_on))
  if gpu:
    cands["compute_on"] = compiled_candidate("compute_on", hand, args,
                                             count_annotations=True)
  else:
    cands["compute_on"] = not_applicable("compute_on")
    cands["compute_on"].annotated_calls = annotated_calls(hand, args)
  cands["jaxstreams"] = compiled_candidate(
      "jaxstreams",
      # Each off-main region a call on its stream: what the suite measures
      # (jaxstreams' default way, and every other, in gpu_levers.py).
      jaxstreams.jit(make_fn(place_jaxstreams), streams=streams,
                     gpu_lowering="streams"),
      args, count_annotations=True)
  return cands


STANDARD_BASELINES = ["jax.jit", "XLA CONCURRENT", "compute_on"]


def standard_case(workload: str, size: dict, make_fn, args, streams: int,
                  notes: str) -> "Case":
  """The case of a model timed against the standard baselines."""
  return Case(workload=workload, size=size, candidate="jaxstreams",
              baselines=list(STANDARD_BASELINES),
              candidates=standard_candidates(make_fn, args, streams),
              notes=notes)


def optax_train_step(loss: Callable, optimizer) -> Callable:
  """``train_step(params, opt_state, *batch)``: one optax step on
  ``loss(params, *batch)``, returning the loss, the new parameters and the
  new optimizer state (how flax.linen models are trained; optax is
  imported when a step runs)."""
  def train_step(params, opt_state, *batch):
    import optax
    value, grads = jax.value_and_grad(lambda p: loss(p, *batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return value, optax.apply_updates(params, updates), opt_state
  return train_step


def normal(key, shape, scale=1.0):
  return jax.random.normal(key, shape, dtype=np.float32) * scale
