"""Admission: whether a request may enter the server, and closing it.

Every request, direct or grouped, holds a token of its model's endpoint (a
``DirectCall``, ``_direct``) from admission until its outcome is settled.
A request admitted at once takes its token in the endpoint's own call,
without a lock; this module is the locked way for the rest:

* ``admit_slowly``: the endpoint found ``queue_size`` requests of its model
  in the server (or the server closing). Refuse it (``ServerClosedError``,
  or ``QueueFullError`` with ``block=False``), or wait for room as ``block``
  says; on return the request holds a token.
* ``wake``: a request ended while someone waits for room or for the server
  to drain.
* ``close``: refuse new requests; ``drain``: wait until every admitted
  request has ended.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Callable


class ServerClosedError(RuntimeError):
  """A request was submitted to a server that is closed or closing."""


class QueueFullError(queue.Full):
  """The server holds ``queue_size`` requests of the model and was made with
  ``block=False`` (or the ``block`` timeout ran out). A ``queue.Full``, so
  code that already catches that keeps working."""


class Admission:

  def __init__(self, name: str, queue_size: int | None, block: bool | float,
               limit: int):
    self.name = name
    self.queue_size = queue_size
    self.block = block
    self.limit = limit                  # tokens per endpoint
    self.grouped = False                # how a request runs, for messages
    self.lock = threading.Lock()
    self.space = threading.Condition(self.lock)    # a token came back
    self.closing = False
    self.space_waiters = 0
    # The endpoints (DirectCall objects, one per model), weakly: the
    # finalizer that closes a server holds its admission, and must not keep
    # the server alive.
    self._endpoints: list[weakref.ref] = []

  def add(self, endpoint) -> None:
    self._endpoints.append(weakref.ref(endpoint))

  def live(self) -> list:
    return [e for e in (ref() for ref in self._endpoints) if e is not None]

  def check_open(self) -> None:
    if self.closing:
      raise ServerClosedError(
          f"{self.name} is closed: it finishes the requests it had admitted "
          "and takes no new ones. Make a new server with "
          "jaxstreams.serve(...).")

  def admit_slowly(self, endpoint) -> None:
    """The locked way of admission (module docstring); on return the
    request holds a token of ``endpoint``."""
    with self.lock:
      self.check_open()
      taken = endpoint._take(self.limit)
      if taken:
        return

      def full() -> bool:
        nonlocal taken
        taken = endpoint._take(self.limit)
        return not taken

      try:
        self._wait_for_space(full)
      except BaseException:
        if taken:               # room came, and so did a close
          endpoint._release()
        raise

  def _wait_for_space(self, full: Callable[[], bool]) -> None:
    """Back-pressure (called holding the lock while ``full()``)."""
    if self.block is False:
      raise QueueFullError(
          f"{self.name}: {self._full_what('is')} and the server was made "
          "with block=False. Retry later, or make it with a larger "
          "queue_size or block=True.")
    deadline = None if self.block is True else time.monotonic() + self.block
    self.space_waiters += 1
    self._set_must_wake(True)
    try:
      while full() and not self.closing:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
          raise QueueFullError(
              f"{self.name}: {self._full_what('stayed')} for "
              f"block={self.block} seconds.")
        self.space.wait(remaining)
    finally:
      self.space_waiters -= 1
      self._set_must_wake(self.space_waiters > 0 or self.closing)
    self.check_open()

  def _set_must_wake(self, value: bool) -> None:
    for endpoint in self.live():
      endpoint._must_wake = value

  def _full_what(self, verb: str) -> str:
    """What is full, truthfully per mode: in direct mode no request waits in
    a queue, the callers' own threads run them, ``queue_size`` at most."""
    n = self.queue_size
    requests = "request" if n == 1 else "requests"
    if not self.grouped:
      return (f"the server {verb} at its limit of {n} {requests} "
              "running at once (direct mode: queue_size bounds the requests "
              "in flight in their callers' threads)")
    return (f"the server {verb} at its limit of {n} {requests} of this model "
            "queued or running (grouped mode: queue_size bounds a model's "
            "requests from admission to result)")

  def wake(self) -> None:
    """A request ended while callers wait for room or close() waits for the
    running ones."""
    with self.lock:
      self.space.notify_all()

  def close(self) -> None:
    """Refuse new requests from now on."""
    with self.lock:
      self.closing = True
      for endpoint in self.live():
        endpoint._admit_limit = -1
      self._set_must_wake(True)
      self.space.notify_all()

  def drain(self, timeout: float | None) -> bool:
    """Wait up to ``timeout`` seconds (None: as long as it takes) for the
    admitted requests to end; returns whether none is left."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self.lock:
      while self.running():
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
          return False
        self.space.wait(remaining)
      return True

  def running(self) -> int:
    return sum(endpoint._running for endpoint in self.live())
