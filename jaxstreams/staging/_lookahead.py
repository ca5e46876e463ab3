"""The pipeline behind ``jaxstreams.prefetch``: items pulled and placed by
worker threads or the consumer's own thread (*inline*), ``size`` slots
ahead, numbered and delivered in order. Workers hold this state, never the
public iterator, so an abandoned iterator is collected and stops them.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

from jaxstreams import _workers
from jaxstreams.staging import _clock, _policy
from jaxstreams.staging._transfer import Transfer

NOT_READY = object()    # what get(wait=False) returns for an item not ready
_SKIPPED = object()     # an item the iterable's exception skips

# A worker waiting for a free slot polls (POLL_FIRST_S doubling up to
# POLL_MAX_S, for POLL_FOR_S) before it parks, so the consumer of short
# steps need not wake it: a system call between two steps, which XLA:CPU's
# asynchronous dispatch makes the next step pay for several times over.
POLL_FIRST_S = 20e-6
POLL_MAX_S = 320e-6
POLL_FOR_S = 2e-3

_VALUE, _ERROR, _END, _SKIP = "value", "error", "end", "skip"


class Pipeline:
  """State shared by the workers and the consumer: item ``k``'s result goes
  to ``results[k]``, whoever produced it."""

  def __init__(self, iterator: Iterator[Any],
               make_transfer: Callable[[int], Transfer], size: int,
               num_threads: int, closed: tuple, ignored: tuple,
               description: str, name: str, mode: str, reason: str,
               upstream: Pipeline | None = None, owned: Any = None):
    self.iterator = iterator
    # An upstream prefetcher's pipeline (stopped first, then closed), and a
    # generator closed once no worker can be inside it.
    self.upstream = upstream
    self.owned = owned
    # Stopped by the pipeline that reads this one, which then closes it:
    # its consumer (that pipeline's worker) must not wait to close it.
    self.owner_stopped = False
    self.transfer = make_transfer(size)
    self.num_threads = num_threads
    self.closed_types = closed
    self.ignored_types = ignored
    self.description = description
    self.lock = threading.RLock()
    self.cond = threading.Condition(self.lock)   # consumers: an item, a stop
    self.work = threading.Condition(self.lock)   # workers: a slot, the right
                                                 # to pull, a switch, a stop
    self.consumers_waiting = 0
    self.workers_parked = 0     # workers waiting on ``work`` (not polling)
    self.free_slots = size
    self.refill_below = (size - 1) // 2   # ready items under which to wake
    self.next_pull = 0          # number of the next item to pull
    self.next_out = 0           # number of the next item to deliver
    # number: (kind, item or exception, seconds producing it, seconds of
    # placing it that needed a core when the consumer produced it inline,
    # else None)
    self.results: dict[int, tuple[str, Any, float, float | None]] = {}
    self.source_done = False    # no more pulls: end, error or stop
    self.stopped = False
    self.pulling = False        # someone is inside next(iterator)
    self.max_in_flight = 0      # pulled but not yet delivered (for tests)
    self.placed = 0             # items placed (Prefetcher.placed)
    self.next_ticket = 0        # order of the items handed to the transfer
    self.live_workers = 0       # threads (and an inline pull) still running
    self.inline_thread = None   # the consumer thread producing an item
    self.released = False       # the transfer's resources were freed
    self.close_owned_on_exit = False   # close() stopped waiting for workers
    chooser = (_policy.for_prefetch(size, self.transfer.shares_cores())
               if mode == "measured" else None)
    self.meter = _policy.Meter(("workers", "inline"), chooser,
                       ("items", "handoff_us", "produce_us"))
    self.mode = "workers" if mode == "workers" else "inline"
    self.reason = reason          # when there is no chooser
    self.inline = self.mode == "inline"
    self.workers = _workers.Workers(name)
    if not self.inline:
      try:
        self._start_workers()
      except BaseException:
        self.stop(join=True)    # no half-started pipeline keeps its workers
        raise

  def _start_workers(self) -> None:
    """Starts the missing worker threads."""
    for i in range(self.num_threads - len(self.workers.threads)):
      with self.lock:
        self.live_workers += 1
      try:
        self.workers.start(f"worker{len(self.workers.threads)}", self._work)
      except BaseException:
        with self.lock:
          self.live_workers -= 1
        raise

  def _classify(self, exc: BaseException) -> str:
    if isinstance(exc, self.closed_types):
      return _END
    if isinstance(exc, self.ignored_types):
      return _SKIP
    return _ERROR

  def _leave(self, inline: bool = False) -> None:
    """A worker or an inline pull is done: the last one out after
    ``stop()`` frees the transfer and closes what is owned."""
    with self.lock:
      self.live_workers -= 1
      if inline:
        self.inline_thread = None
      close_owned = self.live_workers == 0 and self.close_owned_on_exit
      self.cond.notify_all()      # stop() may wait for the last one
    self._release_if_idle()
    if close_owned:           # close(timeout) gave up waiting for us
      self._close_owned(wait=False)

  def _produce(self, wait: bool,
               time_busy: bool = False) -> tuple[str, Any, float]:
    """Pulls the next item, by whoever holds the right to pull (which it
    hands back), and places it: (kind, item or exception, and with
    ``time_busy`` the seconds of placing it that needed a core)."""
    try:
      kind, item = _VALUE, next(self.iterator)
    except StopIteration:
      kind, item = _END, None
    except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
      kind, item = self._classify(exc), exc
    with self.lock:
      self.pulling = False
      # Nothing is pulled past an end or failure.
      self.source_done |= kind in (_END, _ERROR)
      ticket = self.next_ticket     # tickets follow pull order
      self.next_ticket += kind is _VALUE
      if not self.inline and self.workers_parked:
        self.work.notify_all()    # (inline, the workers are parked)
      if kind is not _VALUE or self.stopped:
        return kind, item, 0.0
    try:
      if not time_busy:
        return kind, self.transfer.place(ticket, item, wait), 0.0
      start, began = _clock.reading(), _clock.now()
      item = self.transfer.place(ticket, item, wait)
      return kind, item, _clock.busy(start, _clock.now() - began)
    except BaseException as exc:  # noqa: BLE001
      kind = self._classify(exc)
      if kind in (_END, _ERROR):
        with self.lock:
          self.source_done = True
      return kind, exc, 0.0

  def _wait_for_work(self) -> None:
    """Waits (under self.lock) for a slot and the right to pull, parked
    while the consumer produces inline; for a slot it polls first."""
    sleep_s, poll_until = POLL_FIRST_S, None
    while not self.stopped and not self.source_done and (
        self.free_slots == 0 or self.pulling or self.inline):
      if self.free_slots == 0 and not self.pulling and not self.inline:
        now = time.monotonic()    # not _clock: tests fake that one
        if poll_until is None:
          poll_until = now + POLL_FOR_S
        if now < poll_until:
          self.lock.release()
          try:
            time.sleep(sleep_s)
          finally:
            self.lock.acquire()
          sleep_s = min(2 * sleep_s, POLL_MAX_S)
          continue
      self.workers_parked += 1
      try:
        self.work.wait()
      finally:
        self.workers_parked -= 1
      sleep_s, poll_until = POLL_FIRST_S, None

  def _work(self) -> None:
    try:
      while True:
        with self.lock:
          self._wait_for_work()
          if self.stopped or self.source_done:
            return
          self.free_slots -= 1
          self.pulling = True
          number = self.next_pull
          self.next_pull += 1
          self.max_in_flight = max(self.max_in_flight,
                                   self.next_pull - self.next_out)
        started = _clock.now()
        kind, item, _ = self._produce(wait=True)
        produced = _clock.now() - started
        with self.lock:
          if self.stopped:
            return                  # closed meanwhile: nothing is handed out
          if kind is _VALUE:
            self.placed += 1
          self.results[number] = (kind, item, produced, None)
          if self.consumers_waiting:
            self.cond.notify_all()
    finally:
      self._leave()

  def get(self, timeout: float | None, wait: bool = True) -> Any:
    """The next item in order; raises its exception, StopIteration at the
    end, TimeoutError when it is not ready within ``timeout`` seconds. With
    ``wait=False``, returns NOT_READY at once instead of waiting for a
    worker (inline, the item is produced now, in this thread)."""
    entered = _clock.now()
    waited_s = 0.0
    while True:
      with self.lock:
        number = self.next_out
        result = self.results.pop(number, None)
        if result is not None:
          out = self._hand_out(number, result, entered, waited_s)
          if out is _SKIPPED:
            continue
          return out
        if self.stopped:
          raise StopIteration
        if not (self.inline and number == self.next_pull
                and not self.pulling):
          if not wait:
            return NOT_READY
          waited_s += self._wait_for(number, timeout)
          continue
        # Inline: this thread pulls item ``number`` (all slots are free).
        self.free_slots -= 1
        self.pulling = True
        self.next_pull += 1
        self.live_workers += 1
        self.inline_thread = threading.get_ident()
        self.max_in_flight = max(self.max_in_flight, 1)
      try:
        started = _clock.now()
        kind, item, busy = self._produce(False, self.meter.time_busy)
      except BaseException:     # interrupted between the lines above
        with self.lock:
          self.pulling = False
        self._leave(inline=True)
        raise
      produced = _clock.now() - started
      with self.lock:
        if not self.stopped:
          # Handed out at once: no other consumer can take item ``number``
          # (it is not in ``results``, and the next pull is past it).
          self.live_workers -= 1
          self.inline_thread = None
          if kind is _VALUE:
            self.placed += 1
          out = self._hand_out(number, (kind, item, produced, busy),
                               entered, waited_s)
          if out is _SKIPPED:
            continue
          return out
      self._leave(inline=True)    # closed meanwhile: nothing is handed out
      raise StopIteration

  def _hand_out(self, number: int, result: tuple, entered: float,
                waited_s: float) -> Any:
    """(Under self.lock.) Item ``number``'s result, delivered in item order
    and counted: its value, ``_SKIPPED``, or its end or exception raised."""
    kind, value, produced, busy = result
    self.next_out = number + 1
    self.free_slots += 1
    if (self.workers_parked and not self.inline
        and len(self.results) <= self.refill_below):
      self.work.notify_all()    # half empty: a worker refills it
    if self.consumers_waiting:
      self.cond.notify_all()
    if kind is _SKIP:
      return _SKIPPED
    if kind is not _VALUE:
      self._end(kind, value)
    deliver = self.transfer.deliver
    out = value if deliver is None else deliver(value)
    now = _clock.now()
    made = busy is not None
    if self.meter.count("inline" if made else "workers", now - entered,
                        waited_s, produced, made, now, busy=busy or 0.0):
      self.set_mode(self.meter.chooser.mode)
    return out

  def _wait_for(self, number: int, timeout: float | None) -> float:
    """Waits (under self.lock) until item ``number`` is in, is this
    thread's to produce, or the pipeline stopped; returns the seconds
    waited, or raises TimeoutError after ``timeout``."""
    wait_started = _clock.now()
    self.consumers_waiting += 1
    try:
      ready = self.cond.wait_for(
          lambda: (number in self.results or self.stopped
                   or self.next_out != number       # another consumer took it
                   or (self.inline and number == self.next_pull
                       and not self.pulling)),
          timeout)
    finally:
      self.consumers_waiting -= 1
    if not ready:
      busy = "inside the iterable's __next__" if self.pulling else \
          "placing it on the device"
      raise TimeoutError(
          f"jaxstreams.prefetch: waited more than {timeout} s for item "
          f"{number} of {self.description} (a worker is {busy}; "
          f"{self.next_out} item(s) delivered so far)")
    return _clock.now() - wait_started

  def _halt(self) -> None:
    """(Under self.lock.) Nothing more is pulled or handed out."""
    self.stopped = True
    self.results.clear()
    self.cond.notify_all()
    self.work.notify_all()

  def _end(self, kind: str, value: Any) -> None:
    """Hands out an end or a failure (under self.lock): nothing follows."""
    self._halt()
    if kind is _END:
      raise StopIteration
    raise value

  def set_mode(self, mode: str) -> None:
    """Switches who produces (under self.lock); workers park inline."""
    if mode == "workers" and len(self.workers.threads) < self.num_threads:
      try:
        self._start_workers()
      except RuntimeError as e:   # no thread to be had: stay inline for good
        self.meter.chooser = None
        mode = "inline"
        self.reason = (f"items are produced in the consumer's thread: no "
                       f"worker thread could be started ({e})")
    self.mode = mode
    self.inline = mode == "inline"
    self.work.notify_all()        # parked workers resume, or park

  def stats(self) -> dict[str, Any]:
    with self.lock:
      return self.meter.report(self.mode, self.reason)

  def stop(self, join: bool, timeout: float | None = None) -> bool:
    """Ends the workers (and an upstream pipeline, so a worker waiting on
    it wakes); with ``join``, waits up to ``timeout`` seconds for them and
    an inline pull in another thread. Returns whether all have ended; if
    not, the last one out frees what the pipeline owns."""
    with self.lock:
      self._halt()
    self.transfer.stop()        # wakes a worker waiting in a stage put
    if self.upstream is not None:
      self.upstream.owner_stopped = True
      self.upstream.stop(join=False)
    if not join:
      self._release_if_idle()   # or the last worker does, when it returns
      return False
    deadline = None if timeout is None else time.monotonic() + timeout
    self.workers.join(timeout)
    me = threading.get_ident()
    with self.lock:
      self.cond.wait_for(
          lambda: self.live_workers == (1 if self.inline_thread == me else 0),
          None if deadline is None else max(0.0, deadline - time.monotonic()))
      if self.live_workers > 0:
        self.close_owned_on_exit = True   # the last one out closes them
        return False
    self._release_if_idle()
    return self._close_owned(deadline)

  def _close_owned(self, deadline: float | None = None,
                   wait: bool = True) -> bool:
    """Closes what the pipeline owns, once no worker can be inside it: an
    upstream prefetcher (waited for until ``deadline``, if ``wait``; else
    its own last worker finishes closing it) or a generator (its finally
    blocks run now). Returns whether all of it has ended."""
    if self.upstream is not None:
      if not wait:
        deadline = time.monotonic()
      remaining = (None if deadline is None
                   else max(0.0, deadline - time.monotonic()))
      return self.upstream.stop(join=True, timeout=remaining)
    if self.owned is not None:
      try:
        self.owned.close()
      except Exception:  # noqa: BLE001 - closing is best effort
        pass
    return True

  def _release_if_idle(self) -> None:
    """Frees the transfer's resources once stopped and idle; once."""
    with self.lock:
      if not self.stopped or self.live_workers > 0 or self.released:
        return
      self.released = True
    self.transfer.release()
