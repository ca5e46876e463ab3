"""The lookahead behind ``jaxstreams.prefetch``: items pulled from an
iterable and placed on the device, in order, by worker threads or by the
consumer's own thread (*inline*), a bounded number ahead.

The pipeline, and the guarantees it keeps (both ways, and across a switch):

* **Bounded lookahead.** A worker takes a *slot* before it pulls an item from
  the iterable; the consumer gives the slot back when it receives that item.
  With ``size`` slots, at most ``size`` items have been pulled and not yet
  delivered, so memory is ``size`` items whatever the speed of either side.
  A worker waiting for a slot looks for one again after short sleeps
  (``POLL_*``) before it parks: in a loop of short steps the consumer
  then only takes a ready item and never has to wake a worker (a system
  call between two steps). A parked worker is woken once the lookahead is
  half empty and then fills it.
* **Order.** Pulls from the iterable are serialised (iterators are not
  thread-safe) and numbered; results are delivered by number, so the order is
  the iterable's even when ``num_threads > 1`` workers place items at once.
  Inline, the consumer pulls the next number only once every earlier item
  was delivered (items workers made before a switch come first).
* **Exceptions where they happened.** An exception raised for item ``k``
  (by the iterable or by the placement) is stored as item ``k``'s result: the
  consumer gets items ``< k`` first, then the exception. Types in
  ``closed_exception_types`` end the iteration there (``StopIteration`` from
  the iterable always does: that is the iterator protocol); types in
  ``ignored_exception_types`` make item ``k`` disappear. After any other
  exception no further item is pulled: the iterable is broken, and looking
  past the failure would just hide it.
* **Lifetime.** ``close()``, leaving a ``with`` block, reaching the end, or the
  iterator being garbage-collected stops the workers. Workers hold only the
  shared ``Pipeline`` state, never the public iterator, so an abandoned
  iterator can be collected; a ``weakref.finalize`` then stops them.

Who produces the items is ``mode``: ``"workers"``, ``"inline"``, or
``"measured"``, where ``_chooser.Chooser`` decides from the pipeline's
measurements of itself (``_clock``), and the pipeline switches between the
two at any item.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

from jaxstreams import _workers
from jaxstreams.staging import _clock
from jaxstreams.staging._chooser import SHORT_CYCLE_US, Chooser, Meter, Words
from jaxstreams.staging._transfer import Transfer

# What next_if_ready returns when the next item is not ready.
NOT_READY = object()

# How a worker waits for a free slot: it sleeps ``POLL_FIRST_S``, then twice
# as long each time up to ``POLL_MAX_S``, and looks again, for ``POLL_FOR_S``;
# only then does it park on the condition, which the consumer must signal.
# Why: the consumer's thread, between reading one step's result and
# dispatching the next, is where a short step's loop spends what it loses,
# and on XLA:CPU with asynchronous dispatch even a few microseconds there
# cost the next step up to about 20 us more (benchmarks/cpu_dispatch_gap.py);
# waking a worker is a system call there, every other item at ``size=2``.
# Measured at 0.1 ms steps reading every result (2-core CPU, jax 0.10.2,
# one run of 21 rounds): a hand-written worker woken by the consumer
# 0.83x of the plain loop, one that polls 1.05x; prefetch's own workers
# 0.90x before they polled, 0.96x-1.07x after (several runs). So on
# XLA:CPU with asynchronous dispatch ``mode="measured"`` tries workers at
# short cycles even where producing an item is cheap (the chooser's
# ``unseen_gain``). Polling costs the worker a wake-up per sleep while the
# lookahead is full: about 8 per ``POLL_FOR_S`` (sleeps last 50-70 us
# longer than asked here: the kernel's timer slack), and none once parked.
POLL_FIRST_S = 20e-6
POLL_MAX_S = 320e-6
POLL_FOR_S = 2e-3

# prefetch's steady windows (the Chooser's steady_s): 0.1 s of items, not
# the default 0.01 s. Its judging costs a loop of short steps more than it
# takes (the consumer's time between steps, POLL_FOR_S): at 0.1 ms steps
# reading every result, mode="measured" held in workers by a trial ran 2.2%
# under mode="workers" on average with windows of 10 ms and 0.8% with
# windows of 100 ms, the longer windows ahead in all five processes (by
# 0.4%-3.7%; 31 rounds each, 2-core machine, jax 0.10.2). A change in
# production is then seen within 0.1 s.
STEADY_S = 0.1

# Result kinds stored per item number.
_VALUE, _ERROR, _END, _SKIP = "value", "error", "end", "skip"

# How prefetch words the chooser's decisions (Prefetcher.stats()'s
# ``mode_reason``).
WORDS = Words(
    overlap="workers", inline="inline", unit="items",
    judging=("judging: items are produced in the consumer's thread until "
             "producing one is worth hiding (judged every {window} items)"),
    sure=("producing an item is {share:.0%} of a cycle ({figures}): workers "
          "hide it behind the step"),
    cheap_us=("producing an item takes {us:.0f} us ({figures}), less than a "
              "worker's hand-off and its competition for the CPU cost"),
    cheap_share=("producing an item is {share:.1%} of a cycle ({figures}): a "
                 "worker could save at most that, and its hand-off and "
                 "competition for the CPU cost about as much"),
    busy=("producing an item mostly needs a core ({figures}): a worker "
          "would compete with the step for it rather than hide the work"),
    stays=("{cheap}, so items are produced in the consumer's thread at "
           "next(), as without prefetching"),
    lost_before=" (a trial found workers no faster at {tried:.0%})",
    leave=("producing an item fell to {share:.1%} of a cycle ({figures}) and "
           "the consumer waited for {waited} of {n} items: items are "
           "produced in the consumer's thread at next()"),
    steady=("workers produce the items: producing one is {share:.0%} of a "
            "cycle ({figures})"),
    trial=("trial: producing an item is {share:.0%} of a cycle ({figures}); "
           "comparing cycles with and without workers"),
    trial_unseen=("trial: on CPU with asynchronous dispatch the consumer's "
                  "own time between steps costs a step more than it takes, "
                  "and workers take the placement out of it (producing an "
                  "item is {share:.0%} of a cycle, {figures}); comparing "
                  "cycles with and without workers"),
    result=("median cycle {overlap_us:.0f} us with workers, {inline_us:.0f} "
            "us without; workers faster in {wins} of {rounds} rounds"),
    won="workers produce the items: a trial found them faster ({result})",
    lost=("items are produced in the consumer's thread at next(), a trial "
          "found workers no faster ({result})"))


class Pipeline:
  """State shared by the workers and the consumer (never the public object,
  so that the public iterator can be garbage-collected while workers run).

  Items are numbered in pull order and handed out by number. A worker
  stores item ``k``'s result in ``results``; an inline item is pulled,
  placed and handed out by the consumer's own call, when every earlier item
  has been handed out and no worker is pulling. Either way the pull takes
  the next number under the lock, so switching between the two keeps the
  order, the bound and where each exception is raised."""

  def __init__(self, iterator: Iterator[Any], transfer: Transfer,
               size: int, num_threads: int, closed: tuple, ignored: tuple,
               description: str, name: str, mode: str, reason: str,
               upstream: Pipeline | None = None, owned: Any = None,
               shares_cores: bool = False, unseen_gain: bool = False):
    self.iterator = iterator
    # The iterable's own pipeline when it is another prefetcher (a staged
    # step's chain of stages), stopped first; what the pipeline closes once
    # no worker can be inside the iterable (that prefetcher, a generator).
    self.upstream = upstream
    self.owned = owned
    self.transfer = transfer
    self.size = size
    self.num_threads = num_threads
    self.closed_types = closed
    self.ignored_types = ignored
    self.description = description
    # One lock; ``with self.lock`` where no wait or notify is needed
    # (entering a Condition is a Python-level call: slower per item).
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
    self.results: dict[int, tuple[str, Any, float]] = {}
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
    # What it measures of itself, per way, and mode="measured"'s chooser.
    chooser = (Chooser(size, WORDS, shares_cores=shares_cores,
                       unseen_gain=unseen_gain,
                       unseen_cycle_s=SHORT_CYCLE_US * 1e-6,
                       steady_s=STEADY_S)
               if mode == "measured" else None)
    self.meter = Meter(("workers", "inline"), chooser,
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
    """Starts the worker threads (once; later switches wake them)."""
    for i in range(self.num_threads - len(self.workers.threads)):
      with self.lock:
        self.live_workers += 1
      try:
        self.workers.start(f"worker{len(self.workers.threads)}", self._work)
      except BaseException:
        with self.lock:
          self.live_workers -= 1
        raise

  # Workers -------------------------------------------------------------------
  def _classify(self, exc: BaseException) -> str:
    if isinstance(exc, self.closed_types):
      return _END
    if isinstance(exc, self.ignored_types):
      return _SKIP
    return _ERROR

  def _work(self) -> None:
    try:
      self._work_loop()
    finally:
      self._leave()

  def _leave(self, inline: bool = False) -> None:
    """A worker, or the consumer's inline pull, is done with the iterable
    and the transfer: the last one out after ``stop()`` frees them."""
    with self.lock:
      self.live_workers -= 1
      if inline:
        self.inline_thread = None
      close_owned = self.live_workers == 0 and self.close_owned_on_exit
      self.cond.notify_all()      # stop() may wait for the last one
    self._release_if_idle()
    if close_owned:           # close(timeout) gave up waiting for us
      self._close_owned()

  def _pull(self) -> tuple[str, Any, int]:
    """``next(iterator)`` as (kind, item or exception, ticket), by whoever
    holds the right to pull (``pulling``); hands that right back."""
    try:
      item = next(self.iterator)
      kind = _VALUE
    except StopIteration:
      kind, item = _END, None
    except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
      kind, item = self._classify(exc), exc
    with self.lock:
      self.pulling = False
      if kind in (_END, _ERROR):
        self.source_done = True   # nothing is pulled past an end or failure
      ticket = -1
      if kind == _VALUE:
        # Tickets follow pull order: the transfer may need to place items
        # in order (a stage area is a FIFO) while threads place at once.
        ticket = self.next_ticket
        self.next_ticket += 1
      if not self.inline and self.workers_parked:
        self.work.notify_all()    # (inline, the workers are parked)
    return kind, item, ticket

  def _place(self, kind: str, item: Any, ticket: int,
             wait: bool) -> tuple[str, Any]:
    if kind != _VALUE:
      return kind, item
    try:
      return kind, self.transfer.place(ticket, item, wait)
    except BaseException as exc:  # noqa: BLE001
      kind = self._classify(exc)
      if kind in (_END, _ERROR):
        with self.lock:
          self.source_done = True
      return kind, exc

  def _wait_for_work(self) -> None:
    """Waits (under self.lock) for a slot and the right to pull (pulls are
    serialised to keep order), parked while the consumer produces inline.
    For a slot it polls first (see ``POLL_FOR_S``)."""
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

  def _work_loop(self) -> None:
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
      kind, item, ticket = self._pull()
      if self.stopped:
        return                      # closed while pulling: deliver nothing
      kind, item = self._place(kind, item, ticket, wait=True)
      produced = _clock.now() - started
      with self.lock:
        if self.stopped:
          return                    # closed meanwhile: nothing is handed out
        if kind is _VALUE:
          self.placed += 1
        self.results[number] = (kind, item, produced)
        if self.consumers_waiting:
          self.cond.notify_all()

  # Consumer ------------------------------------------------------------------
  def get(self, timeout: float | None, wait: bool = True) -> Any:
    """The next item in order; raises its exception, StopIteration at the
    end, TimeoutError when it is not ready within ``timeout`` seconds. With
    ``wait=False``, returns NOT_READY at once instead of waiting for a
    worker (inline, the item is produced now, in this thread)."""
    entered = _clock.now()
    waited_s = 0.0
    while True:
      with self.lock:
        # A ready item: the common case in a loop of short steps, where the
        # consumer's time between two steps costs more than itself (on
        # XLA:CPU at gaps of 1-3 us, about 3-4 us per us more:
        # benchmarks/cpu_dispatch_gap.py). So one dict lookup, and no call
        # that is not needed.
        number = self.next_out
        result = self.results.pop(number, None)
        if result is not None:
          kind, value, produced = result
          self.next_out = number + 1
          self.free_slots += 1
          if (self.workers_parked
              and len(self.results) <= self.refill_below):
            self.work.notify_all()    # half empty: a worker refills it
          if self.consumers_waiting:
            self.cond.notify_all()
          if kind is _VALUE:
            # Under the lock: takes from a stage area happen in item order
            # even if several threads call next() at once.
            deliver = self.transfer.deliver
            out = value if deliver is None else deliver(value)
            now = _clock.now()
            if self.meter.count("workers", now - entered, waited_s,
                                produced, False, now):
              self.set_mode(self.meter.chooser.mode)
            return out
          if kind is _SKIP:
            continue
          self._end(kind, value)
        if self.stopped:
          raise StopIteration
        if not (self.inline and number == self.next_pull
                and not self.pulling):
          if not wait:
            return NOT_READY
          waited_s += self._wait_for(number, timeout)
          continue
        # Inline: this thread pulls item ``number`` and places it. It holds
        # the right to pull alone (workers are parked), so the ticket is
        # the next one and the bookkeeping waits for the lock below.
        self.pulling = True
        self.next_pull += 1
        self.live_workers += 1
        self.inline_thread = threading.get_ident()
        if not self.max_in_flight:
          self.max_in_flight = 1
        ticket = self.next_ticket
      try:
        time_busy = self.meter.time_busy
        started = _clock.now()
        busy_start = _clock.reading() if time_busy else None
        try:
          item = next(self.iterator)
          kind = _VALUE
        except StopIteration:
          kind, item = _END, None
        except BaseException as exc:  # noqa: BLE001 - item k's, raised below
          kind, item = self._classify(exc), exc
        if kind is _VALUE:
          self.next_ticket = ticket + 1
          try:
            item = self.transfer.place(ticket, item, False)
          except BaseException as exc:  # noqa: BLE001
            kind, item = self._classify(exc), exc
      except BaseException:     # interrupted between the lines above
        with self.lock:
          self.pulling = False
        self._leave(inline=True)
        raise
      now = _clock.now()
      busy = _clock.busy(busy_start, now - started) if time_busy else 0.0
      with self.lock:
        self.pulling = False
        if kind is _END or kind is _ERROR:
          self.source_done = True
        if not self.stopped:
          self.live_workers -= 1
          self.inline_thread = None
          self.next_out += 1
          if self.consumers_waiting:
            self.cond.notify_all()
          if kind is _VALUE:
            self.placed += 1
            deliver = self.transfer.deliver
            out = item if deliver is None else deliver(item)
            if self.meter.count("inline", now - entered, waited_s,
                                now - started, True, now, busy=busy):
              self.set_mode(self.meter.chooser.mode)
            return out
          if kind is _SKIP:
            continue
          self._end(kind, item)
      self._leave(inline=True)    # closed meanwhile: nothing is handed out
      raise StopIteration

  def _wait_for(self, number: int, timeout: float | None) -> float:
    """Waits (under self.lock) until item ``number`` is in, or is this
    thread's to produce, or the pipeline stopped; returns the seconds
    waited. Raises TimeoutError after ``timeout`` seconds."""
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

  def _end(self, kind: str, value: Any) -> None:
    """Hands out an end or a failure (under self.lock): nothing follows."""
    self.stopped = True
    self.results.clear()
    self.cond.notify_all()
    self.work.notify_all()
    if kind is _END:
      raise StopIteration
    raise value

  def set_mode(self, mode: str) -> None:
    """Switches between workers and inline production (under self.lock):
    workers park while inline, and resume where the numbering is."""
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
    """Ends the workers; with ``join``, waits for them (and for an inline
    pull running in another thread) up to ``timeout`` seconds: one inside
    the iterable's ``__next__`` can only stop once that call returns.
    Returns whether all have ended; when one has not, the last one out
    frees what the pipeline owns.

    When the iterable is another prefetch pipeline (a staged step's chain of
    stages), it is stopped first, so a worker waiting on it wakes up."""
    with self.lock:
      self.stopped = True
      self.results.clear()
      self.cond.notify_all()
      self.work.notify_all()
    self.transfer.stop()        # wakes a worker waiting in a stage put
    if self.upstream is not None:
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
    self._close_owned()
    return True

  def _close_owned(self) -> None:
    """Closes what the pipeline owns: an upstream pipeline (joins its
    workers) and a generator (its finally blocks run now, not at interpreter
    exit). Other iterators (a file the caller opened) are the caller's to
    close. Runs once no worker can be inside the iterator any more."""
    if self.owned is not None:
      try:
        self.owned.close()
      except Exception:  # noqa: BLE001 - closing is best effort
        pass

  def _release_if_idle(self) -> None:
    """Frees the transfer's resources (a stage area) once the pipeline is
    stopped and no worker can touch them any more; exactly once."""
    with self.lock:
      if not self.stopped or self.live_workers > 0 or self.released:
        return
      self.released = True
    self.transfer.release()


