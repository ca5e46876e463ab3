"""``staged``'s fused pipeline: separate programs on one GPU do not overlap
their device work, so each call runs ONE program, the consumer part for
batch ``k`` and producer stage ``j`` for batch ``k + K - j`` (on its own
stream). Staged values are donated to the program that reads them last.
"""

from __future__ import annotations

import collections
from typing import Callable

import jax
from jax import tree_util

from jaxstreams import config
from jaxstreams._jit import jit as streams_jit
from jaxstreams.partition.stages import FUNC, Split
from jaxstreams.staging._splits import Splits
from jaxstreams.staging import _clock
from jaxstreams.staging._lookahead import NOT_READY
from jaxstreams.staging._prefetcher import Prefetcher
from jaxstreams.tag import stream as stream_scope

_SCHEDULE = 64        # programs ``schedule`` remembers


class DataError:
  """Read in place of batch ``k`` whose reading or placing raised."""

  __slots__ = ("exc",)

  def __init__(self, exc: BaseException):
    self.exc = exc


class _InFlight:
  """A batch in the pipeline: its split, the values its later parts need,
  the producer stages done; or the ``error`` batch ``index`` raised."""

  __slots__ = ("index", "split", "env", "done", "error")

  def __init__(self, index, split=None, env=None, error=None):
    self.index, self.split, self.env, self.error = index, split, env, error
    self.done = 0


def _layout(consumer: Split | None, stages: tuple) -> list[tuple]:
  """A fused program's parts in argument order, as ``(split, part, first
  argument)``: the consumer (part ``K``: the other arguments, then its
  carried values), then each producer stage."""
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
  """The arguments a fused program donates: staged values no later part of
  their batch reads, no more of one shape and dtype than it has outputs
  of, none from the first part (newest batch first) that may raise on."""
  n = len(stages)
  free = collections.Counter()
  for split, part, _ in _layout(consumer, stages):
    avals = (split.out_avals if part == n
             else [v.aval for v in split.stage_outs[part]])
    free.update((a.shape, a.dtype) for a in avals)
  donated = []
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
  """The program of ``consumer``'s consumer part and stage ``j`` of
  ``stages[j]`` (each where not None), on flat arguments in ``_layout``'s
  order; cached by the splits' ids (they live in the same cache)."""
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
  """The producer's stream (unless given, the first the step does not use)
  and the program's stream count."""
  consumer_streams = max(streams_now(), first.streams_used)
  stream = consumer_streams if stream is None else stream
  return stream, max(consumer_streams, stream + 1)


class FusedRun:
  """One runner's fused pipeline (the caller's thread only): batches from
  ``held``, then ``resume``'s reader; not ``admitting``, it drains.
  ``first_calls`` counts programs called first (each may have compiled)."""

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
    self.schedule: collections.deque[tuple] = collections.deque(
        maxlen=_SCHEDULE)
    self.programs = 0
    self.read_s = 0.0
    self.wait_s = 0.0
    self.called: set[int] = set()   # the programs (ids) this run has called
    self.first_calls = 0            # ... how many (a compile, maybe)

  def resume(self, reader: Prefetcher, next_index: int) -> None:
    """Admits batches again, from ``reader``; an empty pipeline warms up
    again from batch ``next_index``."""
    self.reader = reader
    self.admitting = True
    if not self.inflight:
      self.warm = False
      self.next_index = next_index

  def _admit(self, block: bool) -> _InFlight | None:
    """The next batch, now in flight, or None (none may enter, none is
    ready and not ``block``, the end, or its read failed)."""
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
        return None
      if block:
        self.wait_s += _clock.now() - started
      batch, seconds = got
      self.read_s += seconds
    if isinstance(batch, DataError):    # batch k's error, raised by call k
      self.ended = True
      entry = _InFlight(self.next_index, error=batch.exc)
    else:
      split = self.splits.split_for(batch)
      entry = _InFlight(self.next_index, split,
                        split.batch_env(tree_util.tree_leaves(batch)))
    self.next_index += 1
    self.inflight.append(entry)
    return None if entry.error else entry

  def _slots(self, consume: bool, block: bool):
    """Who runs next: the head's consumer (when ``consume``) and per stage
    ``j`` the batch that has done ``j`` stages."""
    head = self.inflight[0] if consume else None
    stages: list[_InFlight | None] = [None] * self.k
    for entry in self.inflight:
      if entry is not head and entry.error is None and entry.done < self.k:
        stages[entry.done] = entry
    # A new batch enters while fewer than ``k`` others are in flight.
    if stages[0] is None and len(self.inflight) - consume < self.k:
      stages[0] = self._admit(block)
    return head, stages

  def labels(self) -> list[str]:
    """The schedule in the ``A2 B1 C0`` notation."""
    return [" ".join(f"{chr(ord('A') + part)}{index}" for part, index in pieces)
            for pieces in self.schedule]

  def _run(self, head, stages, other_leaves):
    """Runs one program; returns the consumer's flat outputs (or None)."""
    pieces = [] if head is None else [(self.k, head)]    # oldest batch first
    for j in reversed(range(self.k)):
      entry = stages[j]
      if entry is not None and entry.split.bodies[j] is None:
        self._advance(entry, j, ())       # a stage without work
      elif entry is not None:
        pieces.append((j, entry))
    if not pieces:
      return None
    self.schedule.append(
        tuple((j, e.index) for j, e in enumerate(stages) if e is not None)
        + (() if head is None else ((self.k, head.index),)))
    self.programs += 1
    try:
      return self._call(pieces, other_leaves)
    except Exception as exc:    # noqa: BLE001 - whose batch failed?
      if len(pieces) == 1:
        self._failed(*pieces[0], exc)
        return None
      # Run the pieces one by one, oldest batch first, to raise the error at
      # the batch it belongs to.
      outs = None
      for part, entry in pieces:
        if any(isinstance(x, jax.Array) and x.is_deleted()
               for x in self._inputs(entry, part)):
          raise exc   # donated to the failed program: this call's error
        try:
          got = self._call([(part, entry)], other_leaves)
        except Exception as piece_exc:  # noqa: BLE001
          self._failed(part, entry, piece_exc)
          break   # newer batches were dropped with the failing one
        outs = got if part == self.k else outs
      return outs

  def _call(self, pieces, other_leaves):
    """Runs ``pieces`` (``(part, entry)``) as one program, advances their
    producer stages and returns the consumer's flat outputs (or None)."""
    split_of = {part: entry.split for part, entry in pieces}
    program = _fused_program(
        self.splits.cache, split_of.get(self.k),
        tuple(split_of.get(j) for j in range(self.k)), self.stream,
        self.streams)
    if id(program) not in self.called:     # its first call may compile it
      self.called.add(id(program))
      self.first_calls += 1
    args, may_raise = [], False
    for part, entry in sorted(pieces, key=lambda p: (p[0] != self.k, p[0])):
      if part == self.k:
        args += other_leaves
      args += self._inputs(entry, part)
      may_raise = may_raise or entry.split.may_raise[part]
    outs, produced = program(*args)
    if may_raise:     # raise it here, where ``_run`` finds its batch
      outs, produced = jax.block_until_ready((outs, produced))
    for part, entry in pieces:
      if part < self.k:
        self._advance(entry, part, produced[part])
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

  def _failed(self, part: int, entry: _InFlight, exc: Exception) -> None:
    """Part ``part`` of ``entry`` raised ``exc``: the consumer's is raised
    now, a producer stage's becomes its batch's and ends the pipeline."""
    if part == self.k:
      raise exc
    self.inflight = collections.deque(
        [e for e in self.inflight if e.index < entry.index]
        + [_InFlight(entry.index, error=exc)])
    self.ended = True
    if self.reader is not None:
      self.reader.close()         # nothing is read past a failure

  def step(self, other_leaves):
    """Runs until the head batch is consumed (producer-only programs first
    until it has done every stage); returns its split and flat outputs."""
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
    """The steady-state program for ``split`` and its argument specs."""
    stages = tuple(split if split.bodies[j] is not None else None
                   for j in range(self.k))
    program = _fused_program(self.splits.cache, split, stages, self.stream,
                            self.streams)

    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                 weak_type=v.aval.weak_type)
            for s, part, _ in _layout(split, stages)
            for v in ((s.other_invars if part == self.k else [])
                      + s.stage_ins[part])]
    return program, args

  def close(self) -> None:
    """Stops the reader; staged values still in flight are dropped."""
    if self.reader is not None:
      self.reader.close()
    self.inflight.clear()
    self.ended = True
