"""The batches a staged runner reads, in the caller's thread or in a reader
thread (never both at once), from one ``Source``, so they come in order
whichever way it runs. An exception the iterable raises for batch ``k``
becomes a ``DataError`` in its place, raised by call ``k``.
"""

from __future__ import annotations

import types
from typing import Any, Iterable

from jaxstreams.staging import _clock
from jaxstreams.staging._transfer import place_on_device


class DataError:
  """Read in place of batch ``k`` whose reading or placing raised."""

  __slots__ = ("exc",)

  def __init__(self, exc: BaseException):
    self.exc = exc


class Source:
  """The user's iterable, one batch (or a ``DataError``) per ``next()``,
  one reader at a time. ``close()`` closes a generator iterable."""

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
  """``source``'s batches as ``(batch, seconds its read took)``; closing
  it leaves ``source`` open for the caller's thread."""
  while True:
    started = _clock.now()
    try:
      batch = next(source)
    except StopIteration:
      return
    yield batch, _clock.now() - started


def place(read: tuple[Any, float]) -> tuple[Any, float]:
  """The reader's transform: the batch on the device, complete, and the
  seconds reading and placing it took."""
  batch, seconds = read
  if isinstance(batch, DataError):
    return read
  started = _clock.now()
  try:
    batch = place_on_device(batch)
  except Exception as exc:  # noqa: BLE001 - raised at its batch
    return DataError(exc), seconds
  return batch, seconds + _clock.now() - started
