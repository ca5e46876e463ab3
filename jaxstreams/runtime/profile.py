"""Per-region timing: markers at region boundaries and ``jaxstreams.profile()``.

When profiling is on at trace time, the lowering stage wraps every region in
a BEGIN and an END ``marker`` (on the region's own stream: on a GPU the
marker handler records a CUDA event on the stream XLA runs the region on; on
CPU it reads a steady clock). After the step, ``jaxstreams.profile()`` reads
the markers and writes a Chrome-trace / Perfetto timeline with one track per
stream. With profiling off, the program has no markers at all.

Profiling is on while a ``jaxstreams.profile()`` block is open on this thread,
or when the ``jaxstreams_profile`` option is set. The block also enters
``set_xla_metadata(jaxstreams_profile="on")``: that metadata is part of
``jax.jit``'s cache key, so a function compiled without markers is traced
again inside the block (and not again after it), and the ops traced in the
block carry that frontend attribute.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

from jaxstreams import config

_state = threading.local()
_names: dict[int, str] = {}  # region marker id -> "function/R<k>"
_ids = itertools.count(1)
_ids_lock = threading.Lock()


def profiling_now() -> bool:
  """Whether a function traced now should carry region markers."""
  return getattr(_state, "depth", 0) > 0 or config.read("jaxstreams_profile")


def new_region_id(name: str) -> int:
  with _ids_lock:
    region_id = next(_ids)
  _names[region_id] = name
  return region_id


def wrap_region(fn, region_id: int, stream: int):
  """``fn`` with a BEGIN marker on its inputs and an END marker on its
  outputs."""
  from jaxstreams.runtime import BEGIN, END, marker  # the native library

  def mark(values, phase):
    out = marker(*values, region=region_id, phase=phase, track=stream)
    return list(out) if len(values) > 1 else [out]

  def marked(*args):
    begin = mark(args, BEGIN) if args else []
    outs = list(fn(*begin))
    # END also takes one BEGIN output, so BEGIN stays in the program even
    # when the body reads none of it; without inputs, BEGIN is left out.
    ended = mark(outs + begin[:1], END)
    return ended[: len(outs)]

  return marked


def _step_done() -> None:
  """The host callback that marks a profiled step as finished (see below)."""


def completion_token() -> None:
  """Make the profiled step being traced leave a token that
  ``jax.effects_barrier()`` waits for.

  ``profile()`` must read the markers only after the steps run in its block
  have finished, and jax dispatches asynchronously: a step whose output was
  dropped, or not yet read, may still be running at the block's exit. A
  program with a host callback makes jax keep, per device, a runtime token
  of its last execution, and ``jax.effects_barrier()`` blocks on those. An
  unordered callback is enough (the token is the execution's, wherever the
  callback sits in it) and, unlike an ordered one, jax allows it in a
  process with several devices.
  """
  import jax

  jax.debug.callback(_step_done)


class profile:
  """Profile the jaxstreams.jit steps run inside this block.

      with jaxstreams.profile("trace.json") as prof:
        step(params, batch)
      print(prof.intervals)      # one per region run, with start/end times

  Functions called in the block are traced with region markers (a second
  compilation, cached). On exit the markers are read (waiting for the steps
  to finish), ``prof.timeline`` and ``prof.intervals`` are filled in, and,
  if ``path`` is given, a Chrome-trace JSON is written there (open it in
  ui.perfetto.dev or chrome://tracing). Region names are
  ``<function>/R<k>`` as in ``str(plan)``.
  """

  def __init__(self, path: str | os.PathLike | None = None):
    if path is not None and not isinstance(path, (str, os.PathLike)):
      raise TypeError(
        f"jaxstreams.profile: path must be None or a file path "
        f"(str or os.PathLike), got {path!r} of type "
        f"{type(path).__name__}"
      )
    self.path = path
    self.timeline = None
    self.intervals: list[Any] = []
    self._metadata = None

  def __enter__(self) -> "profile":
    from jax.experimental.xla_metadata import set_xla_metadata
    from jaxstreams.runtime import timeline

    timeline.reset()
    self._metadata = set_xla_metadata(jaxstreams_profile="on")
    self._metadata.__enter__()
    _state.depth = getattr(_state, "depth", 0) + 1
    return self

  def __exit__(self, *exc_info) -> None:
    import jax
    from jaxstreams.runtime import timeline

    _state.depth -= 1
    self._metadata.__exit__(*exc_info)
    jax.effects_barrier()  # the steps' runtime tokens: see completion_token
    self.timeline = timeline.read()
    self.intervals = timeline.intervals(self.timeline.markers)
    if self.path is not None and self.timeline.markers:
      timeline.write_chrome_trace(self.path, self.timeline, dict(_names))

  def region_name(self, region_id: int) -> str:
    return _names.get(region_id, f"region {region_id}")
