"""The batches a staged runner reads: in the caller's thread, or by a reader
thread ahead of the programs that need them.

A runner owns one ``Source`` over the user's iterable for its whole life,
and whoever reads (the caller's thread for the plain step, the reader
thread while it stages, never both at once) reads from it, so batches come
in the iterable's order whichever way the runner runs. An exception the
iterable raises for batch ``k`` becomes a ``DataError`` in its place, the
last item: it is raised by the call for batch ``k`` (a ``KeyboardInterrupt``
the iterable raised stays apart from one that reaches the caller's thread).
The reader thread reads through ``timed`` and places each batch with
``place``, and hands on how long both took: what staging hides, which
``mode="measured"`` weighs.
"""

from __future__ import annotations

import types
from typing import Any, Iterable

from jaxstreams.staging import _clock
from jaxstreams.staging._transfer import place_on_device


class DataError:
  """What is read in place of batch ``k`` whose reading or placing raised:
  the exception, raised by call ``k``."""

  __slots__ = ("exc",)

  def __init__(self, exc: BaseException):
    self.exc = exc


class Source:
  """The user's iterable, one batch (or a ``DataError``) per ``next()``.
  Not thread-safe: one reader at a time. ``close()`` closes a generator
  iterable (its ``finally`` blocks run now); other iterables are the
  caller's to close."""

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


def timed(source: Source):
  """``source``'s batches as ``(batch, seconds its read took)``, for the
  reader thread. A generator: closing it leaves ``source`` open (the
  runner's, which may read on in the caller's thread)."""
  while True:
    started = _clock.now()
    try:
      batch = next(source)
    except StopIteration:
      return
    yield batch, _clock.now() - started


def place(read: tuple[Any, float]) -> tuple[Any, float]:
  """The reader thread's transform: the batch on the device, complete (the
  host-to-device copy happens here, not in the step), and the seconds its
  reading and placing took."""
  batch, seconds = read
  if isinstance(batch, DataError):
    return read
  started = _clock.now()
  try:
    batch = place_on_device(batch)
  except Exception as exc:  # noqa: BLE001 - raised at its batch
    return DataError(exc), seconds
  return batch, seconds + _clock.now() - started
