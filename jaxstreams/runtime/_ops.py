"""Python wrappers of the runtime's FFI handlers (the data plane).

Every wrapper binds a primitive that lowers to one custom call. The ordering
ops (`record`, `wait`, `delay`, `marker`) take one or more arrays and return
them unchanged: use the results, so the op keeps its place in the program
through data dependencies (an op whose results are unused is removed by
jax). The ``stream`` argument is -1 for the stream XLA runs the op on (the
caller's), or k >= 0 for runtime stream k of the pool (see `init`).
"""

from __future__ import annotations

import operator
from typing import Sequence

import jax
import numpy as np

from jaxstreams.runtime import _ffi, _loader, _pool

CALLER = -1

BEGIN, END, INSTANT = 0, 1, 2

identity_p = _ffi.define_op(
  "jaxstreams_identity", "jaxstreams_identity", lambda x: x
)


def _passthrough_avals(*avals, **params):
  return list(avals)


def _ordered_op(name: str, attrs: tuple[str, ...]):
  """A primitive that passes its operands through (aliased) and has a side
  effect on a stream, so XLA keeps it in order: records, waits, delays and
  markers."""
  return _ffi.define_op(
    name,
    name,
    _passthrough_avals,
    attrs=attrs,
    multiple_results=True,
    has_side_effect=True,
    alias_operands=True,
  )


record_p = _ordered_op("jaxstreams_record", ("event", "stream"))
wait_p = _ordered_op("jaxstreams_wait", ("event", "stream"))
delay_p = _ordered_op("jaxstreams_delay", ("microseconds", "stream"))
marker_p = _ordered_op(
  "jaxstreams_marker", ("region", "phase", "track", "stream")
)


def _stage_get_avals(*after, stage, timeout_ms, out_avals):
  return [
    jax.core.ShapedArray(shape, np.dtype(dtype)) for shape, dtype in out_avals
  ]


stage_get_p = _ffi.define_op(
  "jaxstreams_stage_get",
  "jaxstreams_stage_get",
  _stage_get_avals,
  attrs=("stage", "timeout_ms"),
  multiple_results=True,
  has_side_effect=True,
)


def identity(x: jax.typing.ArrayLike) -> jax.Array:
  """Returns a copy of `x` made by the native runtime (any dtype and shape).

  Its purpose is to prove that the native libraries were built, loaded and
  registered: it runs the `jaxstreams_identity` FFI handler, a memcpy on CPU
  and a cudaMemcpyAsync on XLA's stream on CUDA.
  """
  _loader.require("cpu")
  return identity_p.bind(jax.numpy.asarray(x))


def _int(what: str, value) -> int:
  try:
    return operator.index(value)
  except TypeError:
    raise TypeError(
      f"jaxstreams.runtime: {what} must be an int, got {value!r}"
    ) from None


def _check_stream(op: str, stream) -> int:
  stream = _int(f"{op} stream", stream)
  n = _pool.config().streams
  if not CALLER <= stream < n:
    raise ValueError(
      f"jaxstreams.runtime.{op}: stream must be -1 (the caller's stream) or a "
      f"runtime stream in [0, {n}), got {stream}"
    )
  return stream


def _check_event(op: str, event) -> int:
  event = _int(f"{op} event", event)
  n = _pool.config().events
  if not 0 <= event < n:
    raise ValueError(
      f"jaxstreams.runtime.{op}: event must be in [0, {n}), got {event}"
    )
  return event


def _bind_passthrough(op: str, prim, xs: Sequence, **params):
  if not xs:
    raise TypeError(
      f"jaxstreams.runtime.{op} needs at least one array to pass "
      f"through (it orders the op in the program)"
    )
  _loader.require("cpu")
  out = prim.bind(*[jax.numpy.asarray(x) for x in xs], **params)
  return out[0] if len(xs) == 1 else tuple(out)


def record(*xs, event: int, stream: int = CALLER):
  """Records `event` on `stream` once `xs` are computed; returns `xs`.

  The record completes when `stream` reaches this point: at once for the
  caller, after the work queued before it for a runtime stream.
  """
  return _bind_passthrough(
    "record",
    record_p,
    xs,
    event=_check_event("record", event),
    stream=_check_stream("record", stream),
  )


def wait(*xs, event: int, stream: int = CALLER):
  """Makes `stream` wait for `event`'s latest record; returns `xs`.

  With the caller's stream, the ops that use the results run after the
  recorded work finished (CPU: the handler returns a future; CUDA:
  cudaStreamWaitEvent on XLA's stream). An event never recorded does not
  wait, as with CUDA events.
  """
  return _bind_passthrough(
    "wait",
    wait_p,
    xs,
    event=_check_event("wait", event),
    stream=_check_stream("wait", stream),
  )


def delay(*xs, microseconds: int, stream: int = CALLER):
  """Keeps `stream` busy for `microseconds` (a sleep task on a CPU worker, a
  spin kernel on CUDA); returns `xs`. A slow producer for tests and demos."""
  us = _int("delay microseconds", microseconds)
  if us < 0:
    raise ValueError(
      f"jaxstreams.runtime.delay: microseconds must be >= 0, got {us}"
    )
  return _bind_passthrough(
    "delay", delay_p, xs, microseconds=us, stream=_check_stream("delay", stream)
  )


def marker(
  *xs, region: int, phase: int = INSTANT, track: int = 0, stream: int = CALLER
):
  """Timestamps the moment `stream` reaches this point; returns `xs`.

  `region` and `phase` (BEGIN, END, INSTANT) say what the timestamp marks and
  `track` which timeline row it belongs to (the jaxstreams stream id of the
  region). CPU: steady clock; CUDA: an event recorded on the stream, read
  with cudaEventElapsedTime. See `jaxstreams.runtime.timeline`.
  """
  phase = _int("marker phase", phase)
  if phase not in (BEGIN, END, INSTANT):
    raise ValueError(
      f"jaxstreams.runtime.marker: phase must be BEGIN (0), END (1) or "
      f"INSTANT (2), got {phase}"
    )
  return _bind_passthrough(
    "marker",
    marker_p,
    xs,
    region=_int("marker region", region),
    phase=phase,
    track=_int("marker track", track),
    stream=_check_stream("marker", stream),
  )
