"""``staged``'s fused pipeline: one program per call (``mode="fused"``, and
``mode="measured"`` where staging pays).

On a GPU, separate programs on one device do not run their device work at
the same time, so the producer of batch ``k + 1`` can only overlap the
consumer of batch ``k`` inside one program. Each call therefore runs ONE
``jaxstreams.jit`` program that computes the consumer part for batch ``k``
and producer stage ``j`` for batch ``k + K - j`` (``K`` producer stages),
the producer's equations under ``jaxstreams.stream(stream)``: on a GPU they
become a call annotated with that stream (``_xla_stream_annotation``) beside
the consumer on the main stream; on CPU regions are inlined. The staged
values stay on the device from call to call (the pipeline holds at most
``K + 1`` batches), as with TensorFlow's staging areas: the first call warms
up with ``A0; A1 B0; ...``, steady calls run ``A2 B1 C0``, and the last ones
drain (``B4 C3``, ``C4``); a pipeline that stops admitting batches drains the
same way (``mode="measured"`` then runs the plain step). A reader thread (a
``Prefetcher``, made by the runner) pulls the batches from the iterable and
places them on the device ``capacity`` ahead. Once warm, a call takes a new
batch into the pipeline only if the reader has it ready (a slow read never
delays the consumer of a batch already staged; a later program catches
up); programs are cached per set of batch shapes in flight. ``stream=None`` picks the first stream the step does not use itself
(above its own ``stream()`` blocks, and ``N`` for
``jaxstreams.jit(streams=N)``), so the producer never queues behind a
consumer region; the program has ``max(N, stream + 1)`` streams.

Staged values are donated. A value a producer stage made is the runner's
own, and dead once the program that reads it last has run, so that program
gets it with ``donate_argnums``: XLA then writes an output of the same shape
and dtype into its buffer (in the steady state, the next batch's staged
value) instead of allocating one. Never donated: a leaf of the batch
(placing an array that is already on the device returns that very array, the
caller's), a closed-over constant, the step's other arguments, a value a
later part of its batch still reads. Only as many values of a shape and
dtype are donated as the program has outputs of it (jax warns about, and
keeps, a buffer it cannot reuse). A program with a part that can raise while
it runs (a host callback or foreign function call) is waited for, so that
its error is raised by the call that ran it, on a GPU too. A failed program
is run again part by part to find the batch the error belongs to, and a
failed run has taken its donated buffers, so a part donates only when
neither it nor a part of a newer batch contains a host callback or foreign
function call (what can raise in a running program); should a part's input
be gone all the same (a failure of another kind), the error is raised by
this call, whichever batch it belongs to (where XLA raises it at the call,
as XLA:CPU does; a GPU raises it with the results).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import jax
from jax import tree_util

from jaxstreams import config
from jaxstreams._jit import jit as streams_jit
from jaxstreams.staging._analysis import FUNC, Split
from jaxstreams.staging._splits import Splits
from jaxstreams.staging import _clock
from jaxstreams.staging._lookahead import NOT_READY
from jaxstreams.staging._prefetcher import Prefetcher, next_if_ready
from jaxstreams.staging._source import DataError
from jaxstreams.tag import stream as stream_scope

_SCHEDULE = 64        # programs the fused runner remembers for ``schedule``


class _InFlight:
  """A batch inside the fused pipeline: its split, the values its later
  stages and the consumer still need, how many producer stages it has done;
  or, for ``error``, the exception that batch ``index`` raised."""

  __slots__ = ("index", "split", "env", "done", "error")

  def __init__(self, index, split=None, env=None, error=None):
    self.index, self.split, self.env, self.error = index, split, env, error
    self.done = 0


def _layout(consumer: Split | None, stages: tuple) -> list[tuple]:
  """The parts of a fused program in the order of its (flat) arguments, as
  ``(split, part, first argument)``: the consumer (part ``K``; the step's
  other arguments, then its carried values), then each producer stage ``j``
  that runs (part ``j``; its inputs)."""
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
  """The arguments a fused program donates, so that XLA can write its
  outputs into their buffers: values a producer stage made (the runner's
  own, never a leaf of the batch, a constant or an other argument) that no
  later part of their batch reads.

  Only as many of one shape and dtype as the program has outputs of that
  shape and dtype: jax reuses a donated buffer for such an output only, and
  warns about the others ("Some donated buffers were not usable"), which it
  leaves alone anyway. In the steady state the next batch's staged values
  take the buffers of the current one's.

  A program that fails is run again part by part, oldest batch first, up to
  the part that failed (``FusedRun._run``), and a failed run has still taken
  its donated buffers. So a part donates only if neither it nor a part of a
  newer batch can raise while the program runs (``_analysis._MAY_RAISE``)."""
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
  """The ``jaxstreams.jit`` program that runs, in one execution, the consumer
  part of ``consumer``'s batch (when not None) and producer stage ``j`` of
  the batch whose split is ``stages[j]`` (when not None), that stage's
  equations under ``stream(stream)``. Its arguments are flat, in
  ``_layout``'s order, so that single staged values can be donated
  (``_donated``). Cached by the splits' identities (the splits live in the
  same cache, so the ids stay theirs)."""
  # The GPU way is read when the program is made: a program made under
  # another jaxstreams_gpu_lowering is another program.
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
  # The producer is a region on its own stream, run the way
  # jaxstreams_gpu_lowering says (jaxstreams.lower.gpu); mode="measured"
  # measures whether the fused program pays.
  program = streams_jit(fused, streams=streams,
                        donate_argnums=_donated(consumer, stages))
  cache[key] = program
  return program


def producer_stream(first: Split, stream: int | None,
                    streams_now: Callable[[], int]) -> tuple[int, int]:
  """``(stream, streams)``: the producer's stream, the first one the step
  does not use itself unless one was asked for, and the streams the
  program has (every stream either uses)."""
  consumer_streams = max(streams_now(), first.streams_used)
  stream = consumer_streams if stream is None else stream
  return stream, max(consumer_streams, stream + 1)


class FusedRun:
  """One runner's fused pipeline: the batches in flight and the programs
  run. Used from the caller's thread only (the reader thread holds none of
  it). Batches come from a reader (a ``Prefetcher`` of ``(batch, seconds)``
  pairs, ``_source.place``'s) given by ``resume``, first the one ``hold``
  gave; ``stop_admitting`` lets the pipeline drain (each call still consumes
  one batch, no new one enters) so that the runner can run the plain step
  without a batch staged twice or skipped. ``read_s`` and ``wait_s`` add up
  what reading and placing the admitted batches took (in the reader) and
  how long calls waited for the reader; ``first_calls`` counts the programs
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

  def hold(self, batch: Any) -> None:
    """``batch`` (on the device) is the next one to enter."""
    self.held = batch

  def resume(self, reader: Prefetcher, next_index: int) -> None:
    """Admits batches again, from ``reader``; ``next_index`` is the number
    of the next batch (for ``schedule``) when the pipeline is empty. An
    empty pipeline warms up again: its next call waits for its batch."""
    self.reader = reader
    self.admitting = True
    if not self.inflight:
      self.warm = False
      self.next_index = next_index

  def stop_admitting(self) -> None:
    self.admitting = False

  # Reading -------------------------------------------------------------------
  def _admit(self, block: bool) -> _InFlight | None:
    """The next batch from the reader, as a new in-flight entry; None when
    none may enter, or the reader has none ready (``block=False``) or has
    ended."""
    if self.ended or not self.admitting:
      return None
    if self.held is not None:
      batch, self.held = self.held, None
    else:
      started = _clock.now()
      try:
        got = next(self.reader) if block else next_if_ready(self.reader)
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

  # One program ---------------------------------------------------------------
  def _slots(self, consume: bool, block: bool):
    """Who runs in the next program: the consumer's batch (the head, when
    ``consume``) and, per producer stage ``j``, the in-flight batch that has
    done ``j`` stages (at most one: batches enter one per program)."""
    head = self.inflight[0] if consume else None
    stages: list[_InFlight | None] = [None] * self.k
    for entry in self.inflight:
      if entry is not head and entry.error is None and entry.done < self.k:
        stages[entry.done] = entry
    # A new batch enters at stage 0 while the pipeline holds fewer than
    # ``k`` batches besides the one consumed now (the pipeline's depth).
    if stages[0] is None and len(self.inflight) - (1 if consume else 0) < self.k:
      entry = self._admit(block)
      if entry is not None:
        self.inflight.append(entry)
        stages[0] = entry
    return head, stages

  def _label(self, head, stages) -> tuple:
    """(part, batch index) of each piece; ``labels`` spells it out."""
    pieces = [(j, e.index) for j, e in enumerate(stages) if e is not None]
    if head is not None:
      pieces.append((self.k, head.index))
    return tuple(pieces)

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
    self.schedule.append(self._label(head, stages))
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
          # Donated to the failed program (``_donated`` rules this out when
          # it knows how a program can fail): whose error it was cannot be
          # told, so it is this call's.
          raise exc
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
    if may_raise:
      # Where XLA runs asynchronously (a GPU) a failing part's error comes
      # with its results, and would take the older batch's results with
      # it: waiting here raises it in ``_run``, which finds its batch.
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
    """Piece ``(who, entry)`` raised ``exc``: the consumer's error is raised
    now; a producer stage's error becomes its batch's, raised by the call
    for that batch, and nothing after that batch runs."""
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

  # One call ------------------------------------------------------------------
  def step(self, other_leaves):
    """Runs until the head batch is consumed; returns its split and flat
    outputs."""
    # Warm-up (the first call) and catch-up: producer-only programs until
    # the oldest batch has done every stage: ``A0; A1 B0; ...``.
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
    """The steady-state program for ``split``'s batch shapes (consumer of
    batch ``k`` with every producer stage of the following batches) and its
    arguments as ``jax.ShapeDtypeStruct``s."""
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
