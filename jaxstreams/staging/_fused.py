"""``staged``'s fused pipeline: one program per call.

Separate programs on one GPU do not run their device work at the same time,
so the producer of batch ``k + 1`` can overlap the consumer of batch ``k``
only inside one program: each call runs ONE ``jaxstreams.jit`` program with
the consumer part for batch ``k`` and producer stage ``j`` for batch
``k + K - j``, the producer under ``jaxstreams.stream(stream)``. Staged
values stay on the device from call to call (at most ``K + 1`` batches);
the pipeline warms up (``A0; A1 B0``), runs (``A2 B1 C0``) and drains
(``B4 C3``, ``C4``). Once warm, a call admits a new batch only if the
reader has it ready, so a slow read never delays a staged consumer.

Staged values are donated to the program that reads them last (never a
leaf of the batch, a constant or another argument). A failed program is
run again part by part to find the batch its error belongs to, so a part
donates only when neither it nor a newer batch's part can raise while
running (a host callback or foreign call).
"""

from __future__ import annotations

import collections
from typing import Callable

import jax
from jax import tree_util

from jaxstreams import config
from jaxstreams._jit import jit as streams_jit
from jaxstreams.staging._analysis import FUNC, Split
from jaxstreams.staging._splits import Splits
from jaxstreams.staging import _clock
from jaxstreams.staging._lookahead import NOT_READY
from jaxstreams.staging._prefetcher import Prefetcher
from jaxstreams.tag import stream as stream_scope

_SCHEDULE = 64        # programs the fused runner remembers for ``schedule``


class DataError:
  """Read in place of batch ``k`` whose reading or placing raised."""

  __slots__ = ("exc",)

  def __init__(self, exc: BaseException):
    self.exc = exc


class _InFlight:
  """A batch inside the fused pipeline: its split, the values its later
  stages and the consumer still need, how many producer stages it has done;
  or, for ``error``, the exception that batch ``index`` raised."""

  __slots__ = ("index", "split", "env", "done", "error")

  def __init__(self, index, split=None, env=None, error=None):
    self.index, self.split, self.env, self.error = index, split, env, error
    self.done = 0


def _layout(consumer: Split | None, stages: tuple) -> list[tuple]:
  """The parts of a fused program in the order of its flat arguments, as
  ``(split, part, first argument)``: the consumer (part ``K``: the other
  arguments, then its carried values), then each producer stage run."""
  n, parts, first = len(stages), [], 0
  if consumer is not None:
    parts.append((consumer, n, 0))
    first = len(consumer.other_invars) + len(consumer.stage_ins[n])
  for j, split in enumerate(stages):
    if split is not None:
      parts.append((split, j, first))
      first += len(split.stage_ins[j])
  return parts


def _donated(consumer: Split | None, stages: tuple) -> tuple[int, ...]:
  """The arguments a fused program donates: values a producer stage made
  that no later part of their batch reads, only as many of one shape and
  dtype as the program has outputs of it (jax can reuse no other), and
  none from the first part that may raise on (newest batch first)."""
  n = len(stages)
  free = collections.Counter()
  for split, part, _ in _layout(consumer, stages):
    avals = (split.out_avals if part == n
             else [v.aval for v in split.stage_outs[part]])
    free.update((a.shape, a.dtype) for a in avals)
  donated = []
  # Newest batch first: stage 0, 1, ..., then the consumer.
  for split, part, first in sorted(_layout(consumer, stages),
                                   key=lambda p: p[1]):
    if split.may_raise[part]:
      break
    if part == n:
      first += len(split.other_invars)
    for i, v in enumerate(split.stage_ins[part]):
      key = (v.aval.shape, v.aval.dtype)
      if v in split.staged and v not in split.keep_after[part] and free[key]:
        free[key] -= 1
        donated.append(first + i)
  return tuple(sorted(donated))


def _fused_program(cache: dict, consumer: Split | None,
                   stages: tuple, stream: int, streams: int) -> Callable:
  """The program that runs the consumer part of ``consumer``'s batch and
  producer stage ``j`` of ``stages[j]``'s (each when not None), the
  producer under ``stream(stream)``, on flat arguments in ``_layout``'s
  order. Cached by the splits' ids (they live in the same cache) and the
  GPU lowering option in force."""
  key = ("fused", id(consumer), tuple(map(id, stages)), stream, streams,
         config.read("jaxstreams_gpu_lowering"))
  program = cache.get(key)
  if program is not None:
    return program
  n = len(stages)
  layout = _layout(consumer, stages)
  ends = [first for _, _, first in layout[1:]] + [None]

  def fused(*flat):
    outs, produced = None, [None] * n
    for (split, part, first), end in zip(layout, ends):
      if part == n:
        # Emitted as in the step: untagged equations stay on the main stream.
        outs = split.bodies[n](*flat[first:end])
      else:
        # Equations the step placed itself keep their stream (innermost wins).
        with stream_scope(stream):
          produced[part] = split.bodies[part](*flat[first:end])
    return outs, produced

  fused.__name__ = fused.__qualname__ = "jaxstreams_staged_step"
  program = streams_jit(fused, streams=streams,
                        donate_argnums=_donated(consumer, stages))
  cache[key] = program
  return program


def producer_stream(first: Split, stream: int | None,
                    streams_now: Callable[[], int]) -> tuple[int, int]:
  """The producer's stream (the first one the step does not use, unless
  one was asked for) and the program's stream count."""
  consumer_streams = max(streams_now(), first.streams_used)
  stream = consumer_streams if stream is None else stream
  return stream, max(consumer_streams, stream + 1)


class FusedRun:
  """One runner's fused pipeline, used from the caller's thread only.
  Batches come from a reader (``(batch, seconds)`` pairs) given by
  ``resume``, first ``held`` (on the device); not ``admitting``, the
  pipeline drains. ``read_s`` and ``wait_s`` sum what reading the admitted
  batches took and how long calls waited; ``first_calls`` counts programs
  called for the first time (each may have compiled then)."""

  def __init__(self, splits: Splits, stream: int, streams: int):
    self.splits = splits
    self.k = splits.n_producers
    self.stream, self.streams = stream, streams
    self.reader: Prefetcher | None = None
    self.inflight: collections.deque[_InFlight] = collections.deque()
    self.next_index = 0
    self.ended = False            # nothing more comes from the reader
    self.admitting = False        # new batches enter (from resume() on)
    self.held = None              # a batch read elsewhere, admitted first
    self.warm = False             # the warm-up call is over
    self.schedule: collections.deque[tuple] = collections.deque(maxlen=_SCHEDULE)
    self.programs = 0
    self.read_s = 0.0
    self.wait_s = 0.0
    self.called: set[int] = set()   # the programs (ids) this run has called
    self.first_calls = 0            # ... how many (a compile, maybe)

  def resume(self, reader: Prefetcher, next_index: int) -> None:
    """Admits batches again, from ``reader``; ``next_index`` numbers the
    next batch if the pipeline is empty (which then warms up again)."""
    self.reader = reader
    self.admitting = True
    if not self.inflight:
      self.warm = False
      self.next_index = next_index

  def _admit(self, block: bool) -> _InFlight | None:
    """The next batch as a new in-flight entry; None when none may enter
    or the reader has none ready (``block=False``) or has ended."""
    if self.ended or not self.admitting:
      return None
    if self.held is not None:
      batch, self.held = self.held, None
    else:
      started = _clock.now()
      try:
        got = next(self.reader) if block else self.reader.next_if_ready()
      except StopIteration:
        self.ended = True
        return None
      if got is NOT_READY:
        return None               # not read yet: the consumer does not wait
      if block:
        self.wait_s += _clock.now() - started
      batch, seconds = got
      self.read_s += seconds
    if isinstance(batch, DataError):    # batch k's error, raised by call k
      self.ended = True
      self.inflight.append(_InFlight(self.next_index, error=batch.exc))
      self.next_index += 1
      return None
    split = self.splits.split_for(batch)
    entry = _InFlight(self.next_index, split,
                      split.batch_env(tree_util.tree_leaves(batch)))
    self.next_index += 1
    return entry

  def _slots(self, consume: bool, block: bool):
    """Who runs next: the head batch's consumer (when ``consume``) and per
    producer stage ``j`` the batch that has done ``j`` stages."""
    head = self.inflight[0] if consume else None
    stages: list[_InFlight | None] = [None] * self.k
    for entry in self.inflight:
      if entry is not head and entry.error is None and entry.done < self.k:
        stages[entry.done] = entry
    # A new batch enters while fewer than ``k`` others are in flight.
    if stages[0] is None and len(self.inflight) - (1 if consume else 0) < self.k:
      entry = self._admit(block)
      if entry is not None:
        self.inflight.append(entry)
        stages[0] = entry
    return head, stages

  def labels(self) -> list[str]:
    """The schedule in the ``A2 B1 C0`` notation, formatted when asked for."""
    return [" ".join(f"{chr(ord('A') + part)}{index}" for part, index in pieces)
            for pieces in self.schedule]

  def _run(self, head, stages, other_leaves):
    """Runs one program; returns the consumer's flat outputs (or None)."""
    runnable = [e if e is not None and e.split.bodies[j] is not None else None
                for j, e in enumerate(stages)]
    for j, entry in enumerate(stages):
      if entry is not None and runnable[j] is None:   # a stage without work
        self._advance(entry, j, ())
    pieces = ([("consumer", head)] if head is not None else []) + [
        (j, e) for j, e in reversed(list(enumerate(runnable))) if e is not None]
    if not pieces:
      return None
    # (part, batch index) of each piece; ``labels`` spells it out.
    self.schedule.append(
        tuple((j, e.index) for j, e in enumerate(stages) if e is not None)
        + (() if head is None else ((self.k, head.index),)))
    self.programs += 1
    try:
      outs, produced = self._call(head, runnable, other_leaves)
    except Exception as exc:    # noqa: BLE001 - whose batch failed?
      if len(pieces) == 1:
        return self._failed(pieces[0], exc)
      # Run the pieces one by one, oldest batch first, to raise the error at
      # the batch it belongs to (a consumer with effects runs them again).
      outs = None
      for piece in pieces:
        who, entry = piece
        only = [None] * self.k
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in
               self._inputs(entry, self.k if who == "consumer" else who)):
          raise exc   # donated to the failed program: this call's error
        try:
          if who == "consumer":
            outs, _ = self._call(entry, only, other_leaves)
          else:
            only[who] = entry
            _, produced = self._call(None, only, other_leaves)
            self._advance(entry, who, produced[who])
        except Exception as piece_exc:  # noqa: BLE001
          self._failed(piece, piece_exc)
          if who == "consumer":
            raise
          break   # newer batches were dropped with the failing one
      return outs
    for j, entry in enumerate(runnable):
      if entry is not None:
        self._advance(entry, j, produced[j])
    return outs

  def _call(self, head, runnable, other_leaves):
    program = _fused_program(
        self.splits.cache, None if head is None else head.split,
        tuple(None if e is None else e.split for e in runnable),
        self.stream, self.streams)
    if id(program) not in self.called:     # its first call may compile it
      self.called.add(id(program))
      self.first_calls += 1
    args = [] if head is None else [*other_leaves, *self._inputs(head, self.k)]
    may_raise = head is not None and head.split.may_raise[self.k]
    for j, entry in enumerate(runnable):
      if entry is not None:
        args += self._inputs(entry, j)
        may_raise = may_raise or entry.split.may_raise[j]
    outs = program(*args)
    if may_raise:     # raise it here, where ``_run`` finds its batch
      outs = jax.block_until_ready(outs)
    return outs

  @staticmethod
  def _inputs(entry: _InFlight, part: int) -> list:
    return [entry.env[v] for v in entry.split.stage_ins[part]]

  def _advance(self, entry: _InFlight, j: int, outs) -> None:
    split = entry.split
    env = entry.env
    if outs:
      env = {**env, **dict(zip(split.stage_outs[j], outs))}
    keep = split.keep_after[j]
    entry.env = {v: x for v, x in env.items() if v in keep}
    entry.done = j + 1

  def _failed(self, piece, exc):
    """Piece ``(who, entry)`` raised ``exc``: the consumer's is raised now;
    a producer stage's becomes its batch's, and nothing after it runs."""
    who, entry = piece
    if who == "consumer":
      raise exc
    keep = collections.deque()
    for e in self.inflight:
      if e.index < entry.index:
        keep.append(e)
    keep.append(_InFlight(entry.index, error=exc))
    self.inflight = keep
    self.ended = True
    if self.reader is not None:
      self.reader.close()         # nothing is read past a failure
    return None

  def step(self, other_leaves):
    """Runs until the head batch is consumed; returns its split and flat
    outputs. Producer-only programs first until the head has done every
    stage (warm-up, catch-up)."""
    while True:
      if not self.inflight:
        if self.ended:
          raise StopIteration
        if not self.admitting:    # the runner runs a drained pipeline no more
          raise RuntimeError(f"{FUNC}: a drained pipeline was asked for a "
                             "batch")
        block = True
      else:
        head = self.inflight[0]
        if head.error is not None:
          raise head.error
        if head.done == self.k:
          break
        block = not self.warm
      head, stages = self._slots(consume=False, block=block)
      if not self.inflight:
        continue                  # nothing came: ended, or the reader failed
      self._run(None, stages, other_leaves)
    head, stages = self._slots(consume=True, block=not self.warm)
    self.warm = True
    outs = self._run(head, stages, other_leaves)
    if self.inflight and self.inflight[0] is head:
      self.inflight.popleft()
    return head.split, outs

  def step_program(self, split: Split) -> tuple[Callable, list]:
    """The steady-state program for ``split``'s shapes and its arguments
    as ``jax.ShapeDtypeStruct``s."""
    stages = tuple(split if split.bodies[j] is not None else None
                   for j in range(self.k))
    program = _fused_program(self.splits.cache, split, stages, self.stream,
                            self.streams)

    def spec(v):
      a = v.aval
      return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
    args = [spec(v) for v in split.other_invars + split.stage_ins[self.k]]
    for j in range(self.k):
      if stages[j] is not None:
        args += [spec(v) for v in split.stage_ins[j]]
    return program, args

  def close(self) -> None:
    """Stops the reader; staged values still in flight are dropped."""
    if self.reader is not None:
      self.reader.close()
    self.inflight.clear()
    self.ended = True
