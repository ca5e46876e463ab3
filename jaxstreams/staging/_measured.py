"""``staged``'s modes ``"measured"``, ``"fused"`` and ``"plain"``. The one
``Source`` is read by the caller's thread or the reader, never both: going
plain, the pipeline drains, the reader parks and the batches it read run
next; going fused, the reader resumes and the pipeline warms up again.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterable

import jax
from jax import tree_util

from jaxstreams.staging import _clock, _policy
from jaxstreams.partition.stages import Split, with_data
from jaxstreams.staging._fused import DataError, FusedRun, producer_stream
from jaxstreams.staging._prefetcher import Prefetcher
from jaxstreams.staging._splits import Splits
from jaxstreams.staging._transfer import place_on_device


def _platform() -> str:
  """The platform programs run on (a function, so tests can pretend)."""
  return jax.default_backend()


class Source:
  """The user's iterable: one batch per ``next()``, or a ``DataError``
  (batch ``k``'s exception, raised by call ``k``)."""

  def __init__(self, data: Iterable[Any]):
    self._iterator = iter(data)
    self._ended = False

  def __iter__(self) -> Source:
    return self

  def __next__(self) -> Any:
    if self._ended:
      raise StopIteration
    try:
      return next(self._iterator)
    except StopIteration:
      self._ended = True
      raise
    except BaseException as exc:  # noqa: BLE001 - raised at its batch
      self._ended = True
      return DataError(exc)

  def close(self) -> None:
    self._ended = True
    if isinstance(self._iterator, types.GeneratorType):
      self._iterator.close()

  def placed(self):
    """The reader's items: ``(batch on the device, seconds reading and
    placing it took)``; closing it leaves the source open."""
    while True:
      started = _clock.now()
      try:
        batch = next(self)
      except StopIteration:
        return
      if not isinstance(batch, DataError):
        try:
          batch = place_on_device(batch)
        except Exception as exc:  # noqa: BLE001 - raised at its batch
          batch = DataError(exc)
      yield batch, _clock.now() - started


class MeasuredRun:
  """One runner's source, reader (made when it first stages), fused
  pipeline, plain step and meter, made by the first call from the first
  batch; ``plain(split)`` gives the plain step."""

  def __init__(self, splits: Splits, data: Iterable[Any], mode: str,
               capacity: int, stream: int | None,
               streams_now: Callable[[], int],
               plain: Callable[[Split], Callable], data_argnums: int,
               other: tuple):
    self.splits = splits
    self.capacity = capacity
    self.data_argnums = data_argnums
    self.source = Source(data)
    self.reader: Prefetcher | None = None
    self.fused: FusedRun | None = None
    self.calls = 0
    self.restart = False      # the next staged call starts an empty pipeline
    try:
      self.first_started = _clock.now()
      first = next(self.source)              # StopIteration: no data
      self.first_read = _clock.now() - self.first_started
      if isinstance(first, DataError):
        raise first.exc
      splits.use_other(other)
      self.last_split = splits.split_for(first)
      self.stream, self.streams = producer_stream(self.last_split, stream,
                                                  streams_now)
      self.fused = FusedRun(splits, self.stream, self.streams)
      self.plain = plain(self.last_split)
      chooser = (_policy.for_staged(capacity, _platform(), self.stream)
                 if mode == "measured" else None)
      self.way = "plain" if chooser else mode
      self.reason = "" if chooser else f"mode={mode!r} was asked for"
      self.meter = _policy.Meter(("fused", "plain"), chooser,
                                 ("calls", "call_us", "read_us"))
      self.first = first          # the first batch, run by the first call
      if self.way == "fused":
        self.fused.held = place_on_device(first)
        self.first = None
        self._go("fused")
    except BaseException:
      self.close()
      raise

  def call(self, other_args: tuple, kwargs: dict) -> Any:
    """The step's outputs for the next batch; ``StopIteration`` at the end."""
    started = _clock.now()
    if self.way == "fused" or self.fused.inflight:
      return self._staged_call(other_args, kwargs, started)
    return self._plain_call(other_args, kwargs, started)

  def _staged_call(self, other_args: tuple, kwargs: dict,
                   started: float) -> Any:
    """One fused program's call (staging, or draining)."""
    fused = self.fused
    if self.restart:
      leaves = self.splits.use_other((other_args, kwargs))
      self.restart = False
    else:
      leaves = self.splits.check_other((other_args, kwargs))
    read, wait, first_calls = fused.read_s, fused.wait_s, fused.first_calls
    split, outs = fused.step(leaves)
    self.last_split = split
    # A call that may have compiled a program says nothing of its cost.
    self._count("fused", started, fused.read_s - read, fused.wait_s - wait,
                False, judged=fused.first_calls == first_calls)
    return tree_util.tree_unflatten(split.out_tree, outs)

  def _plain_call(self, other_args: tuple, kwargs: dict,
                  started: float) -> Any:
    """The plain step on the first batch, then on the batches the reader
    holds, then on what this thread reads."""
    read, made = 0.0, True
    if self.first is not None:   # read before this call's clock started
      batch, self.first = self.first, None
      started, read = self.first_started, self.first_read
    elif self.reader is not None and self.reader.holds_items():
      batch, _ = next(self.reader)           # StopIteration: the end
      made = False     # read by the reader: not what reading here costs
    else:
      batch = next(self.source)              # StopIteration: the end
      read = _clock.now() - started
    if type(batch) is DataError:
      raise batch.exc
    outs = self.plain(*with_data(other_args, batch, self.data_argnums)[0],
                      **kwargs)
    self._count("plain", started, read, 0.0, made)
    return outs

  def _count(self, way: str, started: float, read: float, wait: float,
             made: bool, judged: bool = True) -> None:
    """One call done: reading its batch took ``read``, it waited ``wait``;
    ``made``: it read the batch."""
    self.calls += 1
    now = _clock.now()
    if self.meter.count(way, now - started, wait, read, made, now, judged):
      self._go(self.meter.chooser.mode)

  def _go(self, way: str) -> None:
    """Switches to ``way`` for the next calls."""
    self.way = way
    fused = self.fused
    if way == "plain":
      fused.admitting = False
      if self.reader is not None:
        self.reader.set_way("inline")       # its workers park
      return
    if self.reader is None:
      self.reader = Prefetcher(self.source.placed(), self.capacity,
                               transform=lambda read: read)
    else:
      self.reader.set_way("workers")
    if not fused.inflight:
      self.restart = True
    fused.resume(self.reader, self.calls)

  def close(self) -> None:
    """Stops the reader and closes the source; idempotent."""
    if self.fused is not None:
      self.fused.close()
    if self.reader is not None:
      self.reader.close()
    self.source.close()
