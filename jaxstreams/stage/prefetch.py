"""``jaxstreams.prefetch``: a host iterator whose items are on the device
before the consumer asks for them.

Why threads: the work that stalls a training loop between steps is host work
(reading, parsing, hashing) and the host-to-device copy. JAX's async dispatch
hides neither of them from a loop that does them in the same thread, which is
what ``flax.jax_utils.prefetch_to_device`` does (it only issues the copies
early). Here worker threads pull items from the iterable and place them with
``jax.device_put`` while the consumer's step runs; the GIL is released while
a producer waits on I/O and while XLA copies or computes, so they overlap.

Never slower than doing without. A worker costs a hand-off per item and
competes with the step for the CPU; where producing an item is cheap there
is nothing for it to hide, and a loop of sub-millisecond steps that reads
each result ran at 0.2x-0.85x of the plain loop with one. So by default
(``mode="auto"``) the consumer's own thread produces each item at ``next()``
(*inline*: pull, then place, as the plain loop would) until the iterator's
measurements of itself say producing one is worth hiding (``_Chooser``);
then workers take over, and they step aside again when production turns
cheap. ``mode="workers"`` / ``"inline"`` force one way; ``stats()`` says
which way it runs and why.

The pipeline, and the guarantees it keeps (both ways, and across a switch):

* **Bounded lookahead.** A worker takes a *slot* before it pulls an item from
  the iterable; the consumer gives the slot back when it receives that item.
  With ``size`` slots, at most ``size`` items have been pulled and not yet
  delivered, so memory is ``size`` items whatever the speed of either side.
  A worker waiting for a slot is woken once the lookahead is half empty and
  then fills it (half the wake-ups, each a system call on both sides, at
  the default ``size=2``).
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
  shared ``_Pipeline`` state, never the public iterator, so an abandoned
  iterator can be collected; a ``weakref.finalize`` then stops them.

Two transfer paths (``transfer=``):

* ``"device_put"``: ``jax.device_put`` (numpy leaves through the call it
  ends in, ``place_on_device``); a worker waits until the copy is done, so an
  item handed out is on the device.
* ``"stage_area"``: the runtime's ``StageArea`` (``jaxstreams.runtime``) with
  ``size`` slots. The first item whose leaves are all numpy arrays fixes the
  structure, shapes and dtypes (dtypes as ``jax.device_put`` would make them:
  float64 becomes float32 without x64) and creates the area. A worker
  ``put()``s each item (on a GPU: into a pinned host slot, then a copy into
  the slot's device buffer on the runtime's copy stream, with a ready event
  per slot; on CPU the CPU runtime's host slots and copy worker); the
  consumer takes it out with a small jitted function, cached per area, that
  calls ``get()`` and returns device arrays. Puts are made in item order
  (a ticket per item, taken when it is pulled), because the area is a FIFO
  and ``get()`` takes the oldest item. An item that does not fit (another
  structure, shape or dtype, or a leaf that is not a numpy array: a Python
  scalar, an array already on a device) is placed with ``jax.device_put``
  instead, in its place in the order, and counted in ``Prefetcher.placed``.
  ``close()`` (and collection, and the end) closes the area, joins the
  workers, waits for the gets already dispatched and destroys the area.
"""

from __future__ import annotations

import collections
import itertools
import statistics
import threading
import time
import types
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

import jax
import numpy as np

from jaxstreams import _checks, _compat, _workers
from jaxstreams._performance import PerformanceWarning

__all__ = ["prefetch", "Prefetcher", "TRANSFERS", "AUTO_TRANSFER"]

_names = itertools.count()

# What the pipeline measures itself with (tests replace it with a fake
# clock: mode="auto" is judged from these readings alone).
_clock = time.perf_counter

# What next_if_ready returns when the next item is not ready.
NOT_READY = object()

# Result kinds stored per item number.
_VALUE, _ERROR, _END, _SKIP = "value", "error", "end", "skip"


def _exception_types(value: Any, name: str) -> tuple[type[BaseException], ...]:
  """A tuple of exception classes from a class or a sequence of them."""
  if isinstance(value, type):
    value = (value,)
  try:
    types = tuple(value)
  except TypeError:
    raise TypeError(f"jaxstreams.prefetch: {name} must be an exception class or "
                    f"a tuple of them, got {value!r} of type "
                    f"{type(value).__name__}") from None
  for t in types:
    if not (isinstance(t, type) and issubclass(t, BaseException)):
      raise TypeError(f"jaxstreams.prefetch: {name} must hold exception classes "
                      f"(subclasses of BaseException), got {t!r} in {value!r}")
  return types


def _positive_int(value: Any, name: str, func: str) -> int:
  return _checks.integer(value, name=name, context=func, minimum=1)


MAX_THREADS = 1024   # far more than the items worth placing at once


def _check_sharding(sharding: Any) -> None:
  """Accepts what ``jax.device_put`` accepts as placement: None, a Device, a
  Sharding, or a pytree (prefix) of them. Checked up front so a typo fails at
  the call, not in a worker thread at the first item."""
  if sharding is None:
    return
  placement = (jax.Device, jax.sharding.Sharding)
  leaves = jax.tree_util.tree_leaves(sharding)
  bad = [leaf for leaf in leaves if not isinstance(leaf, placement)]
  if bad or not leaves:
    raise TypeError(
        f"jaxstreams.prefetch: sharding must be None, a jax.Device, a "
        f"jax.sharding.Sharding or a pytree of them matching the items, got "
        f"{bad[0] if bad else sharding!r} of type "
        f"{type(bad[0] if bad else sharding).__name__}")


def _describe(iterable: Any) -> str:
  """A short description for error messages, made from the iterable's type
  (and length, or a generator's function name), never from its items: a repr
  of a few large numpy arrays costs tens of milliseconds, which every
  ``prefetch()`` call would pay for an error message it rarely prints."""
  if isinstance(iterable, types.GeneratorType):
    return f"generator {iterable.__qualname__}()"
  kind = type(iterable).__qualname__
  try:
    return f"{kind} of {len(iterable)} item(s)"
  except Exception:  # noqa: BLE001 - no len(), or a len() that fails
    return f"{kind} object"


# Who produces the items ------------------------------------------------------

MODES = ("auto", "workers", "inline")

# mode="auto": worker threads only where they pay. A worker hides what it
# takes to produce an item (pull it from the iterable, place it) behind the
# consumer's step, and costs a hand-off per item plus its competition for
# the CPU with the step itself: 11-32 us of CPU time per item in all, 2.5-6
# us of it in the consumer's thread (a 16x32 float32 item, the shared 2-core
# development machine). benchmarks/prefetch_sweep.py measured a loop whose
# step takes under a millisecond and reads its result every step at
# 0.2x-0.85x of the plain loop with a worker, where producing an item cost a
# few microseconds. So the worker has to earn its place: items are produced
# in the consumer's thread (inline, as the plain loop does) until producing
# one is worth hiding, as measured by the consumer itself. Production must
# be a share of the cycle *and* more than a worker costs: a fast consumer
# (a loop that does not wait for its results) makes even a cheap item a
# large share of a short cycle.
WARMUP_ITEMS = 2       # deliveries not judged (the first steps compile)
WINDOW = 16            # items per judgement, and per trial window
TRIAL_ROUNDS = 3       # worker / inline window pairs in one trial
TRY_SHARE = 0.20       # production's share of a cycle worth a trial,
TRY_US = 30.0          # ... when an item also takes this long to produce
SURE_SHARE = 1 / 3     # workers without a trial: they would have to slow
SURE_US = 200.0        # the step by a third to lose, and an item takes
                       # several times what a worker costs
LEAVE_SHARE = 0.05     # workers step aside under this share,
LEAVE_US = 15.0        # ... or when an item takes less than this,
MOSTLY_READY = 0.05    # ... if the consumer waited for this share at most
FIRST_TRIAL_GAP = 256  # judged items between trials (doubling each time)


class _Chooser:
  """``mode="auto"``'s decision, from what the consumer measures for each
  item it receives: its *cycle* (from one ``next()`` returning to the next
  one returning: the step and the hand-off or the production) and the time
  spent *producing* the item (in the consumer's thread when inline, in a
  worker otherwise). Plain bookkeeping, no clock and no thread, so tests
  drive it with made-up times.

  * Inline first. After ``WINDOW`` items, production's share of a cycle is
    the most a worker could save. Under ``TRY_SHARE``, or when an item
    takes under ``TRY_US`` to produce, it stays inline (a worker's hand-off
    and its competition for the CPU would cost about that); from
    ``SURE_SHARE`` and ``SURE_US`` on (checked from the second item) it
    moves to workers at once; in between it runs a *trial*.
  * A trial alternates worker and inline windows of ``WINDOW`` items
    (``TRIAL_ROUNDS`` pairs; the first items after a switch to workers, while
    they fill the lookahead, and in inline windows the items workers had
    made, are not counted) and keeps the mode whose mean cycle won in most
    rounds. Trials are spaced ``FIRST_TRIAL_GAP`` judged items apart,
    doubling, and another one only starts once production's share has at
    least doubled since the last: a trial costs items in the worse mode.
  * In worker mode it steps aside when production falls under
    ``LEAVE_SHARE`` of a cycle or ``LEAVE_US`` per item and the consumer
    almost never waits.
  """

  def __init__(self, size: int):
    self.size = size
    self.mode = "inline"
    self.inline = True
    self.reason = (f"judging: items are produced in the consumer's thread "
                   f"until producing one is worth hiding (judged every "
                   f"{WINDOW} items)")
    self.skip = WARMUP_ITEMS
    self.trial: list[tuple[str, float]] | None = None
    self.trials: list[dict[str, Any]] = []
    self.next_trial = 0        # judged items before a trial may start
    self.gap = FIRST_TRIAL_GAP
    self.tried_share = 0.0     # production's share at the last trial
    self.judged = 0            # items of the finished windows
    self.switches = 0
    self.news: str | None = None   # the first step aside, for the warning
    self._told = False
    self.n = 0
    self._reset()

  def _reset(self) -> None:
    """A new window. Inline (not in a trial) it is first judged at its
    second item, so a producer that clearly needs hiding gets workers soon;
    otherwise once full."""
    self.judged += self.n
    self.n, self.cycle, self.produce, self.waited = 0, 0.0, 0.0, 0
    self.check_at = 2 if self.inline and self.trial is None else WINDOW

  def observe(self, cycle: float, produce: float, inline_made: bool,
              waited: bool) -> bool:
    """One item received: its cycle and production time (seconds), whether
    the consumer's thread made it and whether the consumer waited for it.
    Returns whether ``mode`` changed. (Runs for every item: lean.)"""
    if self.skip:
      self.skip -= 1
      return False
    if self.inline and not inline_made:
      return False     # made by a worker before the switch: not inline's cost
    self.n += 1
    self.cycle += cycle
    self.produce += produce
    if waited:
      self.waited += 1
    if self.n < self.check_at:
      return False
    return self._judge()

  def _judge(self) -> bool:
    if self.trial is not None:
      return self._trial_window()
    share = self.produce / self.cycle if self.cycle > 0 else 0.0
    produce_us = self.produce / self.n * 1e6
    if self.inline:
      if share >= SURE_SHARE and produce_us >= SURE_US:
        return self._switch("workers", (
            f"producing an item is {share:.0%} of a cycle "
            f"({self._figures()}): workers hide it behind the step"))
      if self.n < WINDOW:
        self.check_at = WINDOW
        return False
      if (share >= max(TRY_SHARE, 2 * self.tried_share)
          and produce_us >= TRY_US
          and self.judged + self.n >= self.next_trial):
        return self._start_trial(share)
      if produce_us < TRY_US:
        cheap = (f"producing an item takes {produce_us:.0f} us "
                 f"({self._figures()}), less than a worker's hand-off and "
                 f"its competition for the CPU cost")
      else:
        cheap = (f"producing an item is {share:.1%} of a cycle "
                 f"({self._figures()}): a worker could save at most that, "
                 f"and its hand-off and competition for the CPU cost about "
                 f"as much")
      self.reason = (f"{cheap}, so items are produced in the consumer's "
                     f"thread at next(), as without prefetching")
      if self.trials:
        self.reason += (f" (a trial found workers no faster at "
                        f"{self.tried_share:.0%})")
      self._step_aside_news()
      self._reset()
      return False
    if ((share < LEAVE_SHARE or produce_us < LEAVE_US)
        and self.waited <= MOSTLY_READY * self.n):
      self.tried_share = 0.0
      changed = self._switch("inline", (
          f"producing an item fell to {share:.1%} of a cycle "
          f"({self._figures()}) and the consumer waited for {self.waited} "
          f"of {self.n} items: items are produced in the consumer's thread "
          f"at next()"))
      self._step_aside_news()
      return changed
    if not self.reason.startswith("workers produce the items: a trial"):
      self.reason = (f"workers produce the items: producing one is "
                     f"{share:.0%} of a cycle ({self._figures()})")
    self._reset()
    return False

  def _figures(self) -> str:
    us = 1e6 / self.n
    return (f"{self.produce * us:.0f} us of {self.cycle * us:.0f} us, over "
            f"{self.n} items")

  def _switch(self, mode: str, reason: str) -> bool:
    self.reason = reason
    changed = mode != self.mode
    self.mode = mode
    self.inline = mode == "inline"
    self._reset()
    if not changed:
      return False
    self.switches += 1
    # Workers start from an empty lookahead: the first items after the
    # switch show their refill, not their steady cost.
    self.skip = self.size + 1 if mode == "workers" else 0
    return True

  def _start_trial(self, share: float) -> bool:
    self.trial = []
    self.tried_share = share
    return self._switch("workers", (
        f"trial: producing an item is {share:.0%} of a cycle "
        f"({self._figures()}); comparing cycles with and without workers"))

  def _trial_window(self) -> bool:
    self.trial.append((self.mode, self.cycle / self.n))
    if len(self.trial) < 2 * TRIAL_ROUNDS:
      other = "inline" if self.mode == "workers" else "workers"
      reason = self.reason
      changed = self._switch(other, reason)
      return changed
    workers = [c for mode, c in self.trial if mode == "workers"]
    inline = [c for mode, c in self.trial if mode == "inline"]
    wins = sum(w < i for w, i in zip(workers, inline))
    chose = "workers" if wins > TRIAL_ROUNDS // 2 else "inline"
    w_us, i_us = statistics.median(workers) * 1e6, statistics.median(inline) * 1e6
    self.trials.append({"workers_cycle_us": w_us, "inline_cycle_us": i_us,
                        "workers_won": wins, "rounds": TRIAL_ROUNDS,
                        "chose": chose})
    self.trial = None
    self.next_trial = self.judged + self.gap
    self.gap *= 2
    figures = (f"median cycle {w_us:.0f} us with workers, {i_us:.0f} us "
               f"without; workers faster in {wins} of {TRIAL_ROUNDS} rounds")
    if chose == "workers":
      return self._switch("workers", (
          f"workers produce the items: a trial found them faster "
          f"({figures})"))
    changed = self._switch("inline", (
        f"items are produced in the consumer's thread at next(), a trial "
        f"found workers no faster ({figures})"))
    self._step_aside_news()
    return changed

  def _step_aside_news(self) -> None:
    if not self._told:
      self._told = True
      self.news = self.reason


class _Counters:
  """What the pipeline counts for ``Prefetcher.stats()``, per way of
  producing (seconds, summed over the items delivered)."""
  __slots__ = ("items", "waited", "wait_s", "handoff_s", "produce_s",
               "cycle_s", "cycles")

  def __init__(self):
    self.items = 0          # values delivered to the consumer
    self.waited = 0         # of them, how many the consumer had to wait for
    self.wait_s = 0.0       # the consumer's time waiting for items
    self.handoff_s = 0.0    # its time in next() besides waiting and producing
    self.produce_s = 0.0    # pulling and placing the items
    self.cycle_s = 0.0      # from one next() returning to the next returning
    self.cycles = 0         # cycles measured (not before the first item)

  def per_item(self) -> dict[str, Any]:
    us = 1e6 / max(self.items, 1)
    return {"items": self.items, "waited": self.waited,
            "wait_us": self.wait_s * us, "handoff_us": self.handoff_s * us,
            "produce_us": self.produce_s * us,
            "cycle_us": self.cycle_s * 1e6 / max(self.cycles, 1)}


class _Pipeline:
  """State shared by the workers and the consumer (never the public object,
  so that the public iterator can be garbage-collected while workers run).

  Items are numbered in pull order and handed out by number. A worker
  stores item ``k``'s result in ``results``; an inline item is pulled,
  placed and handed out by the consumer's own call, when every earlier item
  has been handed out and no worker is pulling. Either way the pull takes
  the next number under the lock, so switching between the two keeps the
  order, the bound and where each exception is raised."""

  def __init__(self, iterator: Iterator[Any], transfer: _Transfer,
               size: int, num_threads: int, closed: tuple, ignored: tuple,
               description: str, name: str, mode: str, reason: str):
    self.iterator = iterator
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
    self.counters = {False: _Counters(), True: _Counters()}  # by inline_made
    self.last_delivery = None          # perf_counter() when an item went out
    self.news: str | None = None       # the chooser stepped aside: to tell
    self.chooser = _Chooser(size) if mode == "auto" else None
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
      if not self.inline:
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

  def _work_loop(self) -> None:
    while True:
      with self.lock:
        # A slot, and the right to pull (pulls are serialised to keep order);
        # parked while the consumer produces inline.
        while not self.stopped and not self.source_done and (
            self.free_slots == 0 or self.pulling or self.inline):
          self.work.wait()
        if self.stopped or self.source_done:
          return
        self.free_slots -= 1
        self.pulling = True
        number = self.next_pull
        self.next_pull += 1
        self.max_in_flight = max(self.max_in_flight,
                                 self.next_pull - self.next_out)
      started = _clock()
      kind, item, ticket = self._pull()
      if self.stopped:
        return                      # closed while pulling: deliver nothing
      kind, item = self._place(kind, item, ticket, wait=True)
      produced = _clock() - started
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
    entered = _clock()
    waited_s = 0.0
    while True:
      with self.lock:
        number = self.next_out
        if number in self.results:
          kind, value, produced = self.results.pop(number)
          self.next_out += 1
          self.free_slots += 1
          if len(self.results) <= self.refill_below:
            self.work.notify_all()    # half empty: a worker refills it
          if self.consumers_waiting:
            self.cond.notify_all()
          if kind is _VALUE:
            # Under the lock: takes from a stage area happen in item order
            # even if several threads call next() at once.
            out = self.transfer.deliver(value)
            self._count(entered, waited_s, produced, False,
                        _clock())
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
      started = _clock()
      try:
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
      now = _clock()
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
            out = self.transfer.deliver(item)
            self._count(entered, waited_s, now - started, True, now)
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
    wait_started = _clock()
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
    return _clock() - wait_started

  def _end(self, kind: str, value: Any) -> None:
    """Hands out an end or a failure (under self.lock): nothing follows."""
    self.stopped = True
    self.results.clear()
    self.cond.notify_all()
    self.work.notify_all()
    if kind is _END:
      raise StopIteration
    raise value

  def _count(self, entered: float, waited_s: float, produced_s: float,
             inline_made: bool, now: float) -> None:
    """Adds one delivered item to the counters, and lets ``mode="auto"``
    judge (under self.lock)."""
    c = self.counters[inline_made]
    c.items += 1
    if waited_s > 0:
      c.waited += 1
      c.wait_s += waited_s
    c.handoff_s += now - entered - waited_s - (produced_s if inline_made
                                               else 0.0)
    c.produce_s += produced_s
    last, self.last_delivery = self.last_delivery, now
    if last is None:
      return
    cycle = now - last
    c.cycle_s += cycle
    c.cycles += 1
    chooser = self.chooser
    if chooser is None:
      return
    if chooser.observe(cycle, produced_s, inline_made, waited_s > 0):
      self._set_mode(chooser.mode)
    if chooser.news is not None:
      self.news, chooser.news = chooser.news, None

  def _set_mode(self, mode: str) -> None:
    """Switches between workers and inline production (under self.lock):
    workers park while inline, and resume where the numbering is."""
    if mode == "workers" and len(self.workers.threads) < self.num_threads:
      try:
        self._start_workers()
      except RuntimeError as e:   # no thread to be had: stay inline for good
        self.chooser = None
        mode = "inline"
        self.reason = (f"items are produced in the consumer's thread: no "
                       f"worker thread could be started ({e})")
    self.mode = mode
    self.inline = mode == "inline"
    self.work.notify_all()        # parked workers resume, or park

  def stats(self) -> dict[str, Any]:
    with self.lock:
      chooser = self.chooser
      reason = self.reason if chooser is None else chooser.reason
      return {"mode": self.mode, "mode_reason": reason,
              "items": sum(c.items for c in self.counters.values()),
              "switches": chooser.switches if chooser else 0,
              "trials": list(chooser.trials) if chooser else [],
              "workers": self.counters[False].per_item(),
              "inline": self.counters[True].per_item()}

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
    upstream = self.iterator
    if isinstance(upstream, Prefetcher):
      upstream._pipeline.stop(join=False)
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
    upstream = self.iterator
    if isinstance(upstream, (Prefetcher, types.GeneratorType)):
      try:
        upstream.close()
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


def next_if_ready(prefetcher: Prefetcher) -> Any:
  """The prefetcher's next item if it is ready now, else ``NOT_READY``: no
  waiting for a worker and no exception to build. Package-internal, for
  ``staged``'s fused runner, which polls its reader every call and must
  never wait for a batch the reader has not finished; the end and item
  errors are raised as by ``next``. (Where items are produced inline, the
  item is produced now, in the calling thread: staged's reader keeps its
  workers.)"""
  return prefetcher._get(wait=False)


def _stop_unjoined(pipeline: _Pipeline) -> None:
  # Run by weakref.finalize at collection time: it may run on any thread,
  # even a worker, so it only signals.
  pipeline.stop(join=False)


class Prefetcher:
  """The iterator ``jaxstreams.prefetch`` returns; see there.

  Iterate it, or use it as a context manager; ``close()`` stops the workers
  and waits for them. Attributes: ``size``, ``num_threads``, ``timeout``,
  ``mode`` (the mode asked for; ``stats()["mode"]`` is the way it runs).
  """

  def __init__(self, iterable: Iterable[Any], size: int, *,
               transform: Callable[[Any], Any] | None = None, num_threads: int,
               timeout: float | None, closed_exception_types: tuple,
               ignored_exception_types: tuple, func: str = "jaxstreams.prefetch",
               transfer: _Transfer | None = None, warn: bool = False,
               mode: str = "workers"):
    if (transform is None) == (transfer is None):
      raise TypeError(f"{func}: give exactly one of transform and transfer")
    if transfer is None:
      transfer = _FunctionTransfer(transform)
    self.transfer = transfer.name
    self.size = size
    self.num_threads = num_threads
    self.timeout = timeout
    self.mode = mode
    try:
      iterator = iter(iterable)
    except TypeError:
      transfer.release()
      raise TypeError(f"{func}: iterable must be iterable, got {iterable!r} "
                      f"of type {type(iterable).__name__}") from None
    reason = f"mode={mode!r} was asked for"
    if mode == "auto" and timeout is not None:
      # A wait can only time out on an item another thread produces.
      mode, reason = "workers", (
          f"workers produce the items: timeout={timeout} was given, and "
          f"only a wait for a worker can time out")
    name = f"jaxstreams-prefetch-{next(_names)}"
    self._transfer = transfer
    self._closed = False
    # Only the public prefetch() warns: a staged step's internal pipelines
    # are its own business.
    self._warn = warn
    self._pipeline = _Pipeline(
        iterator, transfer, size, num_threads,
        closed_exception_types, ignored_exception_types,
        _describe(iterable), name, mode, reason)
    self._finalizer = weakref.finalize(self, _stop_unjoined, self._pipeline)

  def __iter__(self) -> Prefetcher:
    return self

  def __next__(self) -> Any:
    return self._get(True)

  def _get(self, wait: bool) -> Any:
    pipeline = self._pipeline
    try:
      item = pipeline.get(self.timeout, wait)
    except TimeoutError:
      raise             # the item may still come: stay usable
    except BaseException:
      if not self._closed:   # after close(timeout) gave up: do not wait now
        self.close()    # the end, or item k's exception: nothing follows
      raise
    if pipeline.news is not None:
      self._tell()
    return item

  def _tell(self) -> None:
    """The one ``PerformanceWarning``: prefetching stepped aside."""
    pipeline = self._pipeline
    news, pipeline.news = pipeline.news, None
    if self._warn and news:
      warnings.warn(
          f"jaxstreams.prefetch does not pay here and stepped aside: {news} "
          f"(Prefetcher.stats() has the figures; prefetch(mode='workers') "
          f"keeps worker threads; filter jaxstreams.PerformanceWarning to "
          f"silence this)", PerformanceWarning, stacklevel=4)

  def close(self, timeout: float | None = None) -> bool:
    """Stops the workers and waits up to ``timeout`` seconds (None: as long
    as it takes) for them to exit; returns whether they have. A worker
    blocked inside the iterable's ``__next__`` exits when that call returns,
    delivers nothing, and then closes what the iterator owns (a generator
    iterable, a stage area). Idempotent."""
    timeout = _checks.timeout(timeout, name="timeout", context="Prefetcher.close")
    self._closed = True
    self._finalizer.detach()
    return self._pipeline.stop(join=True, timeout=timeout)

  def stats(self) -> dict[str, Any]:
    """How this iterator runs and why, from its own counters: ``mode``
    (``"workers"``: worker threads produce the items; ``"inline"``: the
    consumer's thread does, at ``next()``) and ``mode_reason``; ``items``
    delivered; ``switches`` between the two and the ``trials`` that compared
    them (``mode="auto"``); and per way of producing (``"workers"``,
    ``"inline"``): ``items``, ``waited`` (how many the consumer waited for),
    and per item ``wait_us``, ``handoff_us`` (the consumer's time in
    ``next()`` besides waiting and producing), ``produce_us`` (pulling and
    placing) and ``cycle_us`` (from one ``next()`` returning to the next)."""
    return self._pipeline.stats()

  @property
  def max_in_flight(self) -> int:
    """Most items ever pulled from the iterable and not yet delivered
    (at most ``size``: the lookahead bound, exposed for tests)."""
    return self._pipeline.max_in_flight

  @property
  def threads(self) -> list[threading.Thread]:
    """The worker threads started so far (none while items have only been
    produced inline)."""
    return list(self._pipeline.workers.threads)

  @property
  def placed(self) -> dict[str, int]:
    """How many items each path placed so far: ``{"device_put": n,
    "stage_area": m}`` (with ``transfer="stage_area"``, ``device_put``
    counts the items that did not fit the stage area)."""
    return self._transfer.counts(self._pipeline.placed)

  @property
  def stage(self) -> Any:
    """The ``jaxstreams.runtime.StageArea`` in use (``transfer="stage_area"``,
    once the first item that fits was placed), else None. It is destroyed
    when the iterator stops (its ``stats()`` then raises)."""
    return getattr(self._transfer, "area", None)

  def __enter__(self) -> Prefetcher:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def __repr__(self) -> str:
    return (f"<jaxstreams.prefetch of {self._pipeline.description}, "
            f"size={self.size}, num_threads={self.num_threads}, "
            f"transfer={self.transfer!r}, mode={self.mode!r} "
            f"({self._pipeline.mode})>")


# Transfers -------------------------------------------------------------------

TRANSFERS = ("auto", "device_put", "stage_area")

# What transfer="auto" picks, by jax.default_backend(), from the figures of
# benchmarks/prefetch.py (benchmarks/results/prefetch_<backend>.json).
# CPU: measured; see the "transfer" case there. GPU: not measured by this
# project yet (no GPU was available to the session that wrote the stage-area
# path), so it stays on jax.device_put until a GPU measurement supports the
# stage area. Other backends have no runtime library: device_put.
AUTO_TRANSFER = {"cpu": "device_put", "gpu": "device_put"}

# A get is only dispatched for an item already put, so it never waits for a
# producer; the bound only turns a runtime bug into an error, not a hang.
_GET_TIMEOUT_MS = 60_000


class _Transfer:
  """How an item is placed and how the consumer receives it.

  ``place(ticket, item, wait)`` runs in a worker, or in the consumer when
  items are produced inline (tickets are 0, 1, 2... in pull order, one per
  item pulled; ``wait``: return only once the copies are done, as a worker
  does so that an item handed out is on the device and the lookahead bound
  counts device memory); ``deliver(value)`` runs in the consumer, under the
  pipeline's lock, in item order, with what ``place`` returned; ``stop()``
  may run on any thread and only signals; ``release()`` runs once, when no
  worker is left and nothing more will be delivered."""

  name = "custom"

  def place(self, ticket: int, item: Any, wait: bool) -> Any:
    raise NotImplementedError

  def deliver(self, value: Any) -> Any:
    return value

  def stop(self) -> None:
    pass

  def release(self) -> None:
    pass

  def counts(self, placed: int) -> dict[str, int]:
    """``Prefetcher.placed``, given how many items were placed."""
    return {}


class _FunctionTransfer(_Transfer):
  """A plain function of the item (``Prefetcher(transform=...)``)."""

  def __init__(self, transform: Callable[[Any], Any]):
    self.transform = transform

  def place(self, ticket: int, item: Any, wait: bool) -> Any:
    return self.transform(item)


def _host_arrays(item: Any) -> Any:
  """``item`` with its leaves on jax's default device, when every leaf is
  a numpy array (or scalar) of a canonical device dtype; else None. Through
  ``_compat.host_array_to_device``: jax.device_put's own last call, about a
  sixth of its cost on a small array (and copied, so the producer may reuse
  its numpy buffers)."""
  if type(item) is np.ndarray:     # the common item, without a tree walk
    if _canonical(item.dtype):
      return _compat.host_array_to_device(item)
    return None
  leaves, treedef = jax.tree_util.tree_flatten(item)
  if not leaves:
    return None
  placed = []
  for leaf in leaves:
    if type(leaf) is not np.ndarray:
      if not isinstance(leaf, (np.ndarray, np.generic)):
        return None     # a Python scalar (weakly typed), a jax array, ...
      leaf = np.asarray(leaf)
    if not _canonical(leaf.dtype):
      return None
    array = _compat.host_array_to_device(leaf)
    if array is None:
      return None
    placed.append(array)
  return treedef.unflatten(placed)


def _canonical(dtype: np.dtype) -> bool:
  """Whether arrays of ``dtype`` go to the device unchanged: a device dtype
  that jax does not convert (float64 without x64 becomes float32)."""
  if not dtype.isnative or (dtype.kind not in "biufc"
                            and dtype.name not in _EXTRA_DTYPES):
    return False      # (jax refuses big-endian arrays; it reads no bytes)
  return jax.dtypes.canonicalize_dtype(dtype) == dtype


def place_on_device(item: Any, sharding: Any = None, wait: bool = True) -> Any:
  """``jax.device_put(item, sharding)``: the same arrays, bit for bit, with
  the same dtypes, weak types and devices; numpy leaves placed on the
  default device cheaply (``_host_arrays``). With ``wait``, returns once
  the copies are done. Used by prefetch and by staged's reader."""
  out = _host_arrays(item) if sharding is None else None
  if out is None:
    out = jax.device_put(item, sharding)
  if wait:
    if type(out) is _compat.ARRAY_TYPE:
      out.block_until_ready()     # one array: no tree walk
    else:
      jax.block_until_ready(out)
  return out


class _DevicePutTransfer(_Transfer):
  name = "device_put"

  def __init__(self, sharding: Any):
    self.sharding = sharding

  def place(self, ticket: int, item: Any, wait: bool) -> Any:
    return place_on_device(item, self.sharding, wait)

  def counts(self, placed: int) -> dict[str, int]:
    return {"device_put": placed, "stage_area": 0}


class _InStage:
  """What a worker hands the consumer for an item waiting in the stage area:
  its structure (the area holds the flat leaves)."""
  __slots__ = ("treedef",)

  def __init__(self, treedef: Any):
    self.treedef = treedef


def _stageable_leaves(item: Any) -> tuple[Any, list[np.ndarray]] | None:
  """(treedef, leaves as the numpy arrays ``jax.device_put`` would copy), or
  None when a leaf is not a numpy array of a dtype a device holds."""
  leaves, treedef = jax.tree_util.tree_flatten(item)
  if not leaves:
    return None
  arrays = []
  for leaf in leaves:
    # Python scalars become weakly typed arrays under device_put, jax arrays
    # are already placed: neither goes through the area.
    if not isinstance(leaf, (np.ndarray, np.generic)):
      return None
    dtype = leaf.dtype
    if not dtype.isnative or (dtype.kind not in "biufc"
                              and dtype.name not in _EXTRA_DTYPES):
      return None     # device_put refuses a big-endian array: so do we
    try:
      canonical = jax.dtypes.canonicalize_dtype(dtype)
    except (TypeError, ValueError):
      return None
    # The same conversion device_put makes (float64 -> float32 without x64).
    arrays.append(np.asarray(leaf, dtype=canonical, order="C"))
  return treedef, arrays


# ml_dtypes' types have numpy kind "V"; they are ordinary device dtypes.
_EXTRA_DTYPES = frozenset({
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e3m4", "float8_e4m3",
    "float8_e8m0fnu", "int4", "uint4", "int2", "uint2", "float4_e2m1fn"})


class _StageAreaTransfer(_Transfer):
  """Items through a ``jaxstreams.runtime.StageArea`` of ``size`` slots."""

  name = "stage_area"

  def __init__(self, size: int, platform: str):
    self.size = size
    self.platform = platform
    self.cond = threading.Condition()
    self.turn = 0               # the ticket whose turn it is to put
    self.stopped = False
    self.area = None            # created by the first item that fits
    self.spec = None            # ((shape, dtype), ...) of its leaves
    self.treedef = None
    self.getter = None
    self.pending = collections.deque()   # gets dispatched, maybe not run yet
    self.staged = 0
    self.fallbacks = 0

  # Worker side -----------------------------------------------------------------
  def place(self, ticket: int, item: Any, wait: bool) -> Any:
    with self.cond:
      while self.turn != ticket and not self.stopped:
        self.cond.wait()
      if self.stopped:
        raise _Stopped
    fits = False
    try:
      flat = _stageable_leaves(item)
      if flat is not None:
        treedef, arrays = flat
        spec = tuple((a.shape, a.dtype) for a in arrays)
        if self.area is None and sum(a.nbytes for a in arrays) > 0:
          self._create(spec, treedef)
        fits = self.area is not None and spec == self.spec and (
            treedef == self.treedef)
      if fits:
        # Blocks while the area is full (a get dispatched but not yet run);
        # stop() closes the area, which ends the wait with StageClosedError.
        self.area.put(arrays)
        with self.cond:
          self.staged += 1
        return _InStage(treedef)
    finally:
      with self.cond:
        self.turn += 1          # the next ticket may put now
        self.cond.notify_all()
    out = place_on_device(item, None, wait)
    with self.cond:
      self.fallbacks += 1
    return out

  def _create(self, spec, treedef) -> None:
    from jaxstreams import runtime   # pylint: disable=import-outside-toplevel
    with self.cond:
      if self.stopped:
        raise _Stopped
      self.area = runtime.StageArea(
          [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in spec],
          capacity=self.size, platform=self.platform)
      self.spec, self.treedef = spec, treedef
      area = self.area
      # One small program per area: the area's id is an attribute of the
      # custom call. The extra scalar is written by the same execution; the
      # consumer keeps it to know when the get has run (the arrays handed out
      # may be donated or deleted by then).
      self.getter = jax.jit(lambda: (area.get(timeout_ms=_GET_TIMEOUT_MS),
                                     jax.numpy.zeros((), jax.numpy.int32)))

  # Consumer side ---------------------------------------------------------------
  def deliver(self, value: Any) -> Any:
    if not isinstance(value, _InStage):
      return value              # placed with device_put
    leaves, done = self.getter()
    while self.pending and self.pending[0].is_ready():
      self.pending.popleft()
    self.pending.append(done)
    return value.treedef.unflatten(leaves)

  # Lifetime ----------------------------------------------------------------------
  def stop(self) -> None:
    with self.cond:
      self.stopped = True
      self.cond.notify_all()
      area = self.area
    if area is not None:
      area.close()              # a put waiting for a free slot fails now

  def release(self) -> None:
    with self.cond:
      self.stopped = True
      self.cond.notify_all()
      area = self.area          # kept, destroyed: stats() says so
      pending, self.pending = list(self.pending), collections.deque()
    if area is None:
      return
    # A get dispatched but not yet run would find no area: wait for them.
    for done in pending:
      try:
        done.block_until_ready()
      except Exception:  # noqa: BLE001 - its error went to the item's user
        pass
    area.destroy()

  def counts(self, placed: int) -> dict[str, int]:
    with self.cond:
      return {"device_put": self.fallbacks, "stage_area": self.staged}


class _Stopped(Exception):
  """The pipeline stopped while a worker waited for its turn to put."""


def _stage_platform(sharding: Any) -> tuple[str | None, str]:
  """The runtime platform a stage area would use, or None and why not."""
  if sharding is not None:
    return None, ("it places items on jax's default device only, and "
                  f"sharding={sharding!r} was given")
  backend = jax.default_backend()
  platform = {"cpu": "cpu", "gpu": "cuda"}.get(backend)
  if platform is None:
    return None, f"the native runtime has no {backend!r} implementation"
  try:
    from jaxstreams import runtime   # pylint: disable=import-outside-toplevel
    available = runtime.available_platforms()
  except Exception as e:  # noqa: BLE001 - reported in the message
    return None, f"the native runtime could not be loaded ({e})"
  if platform not in available:
    return None, (f"the runtime library for {platform!r} is not built or not "
                  f"found (loaded: {list(available)}; set "
                  f"{runtime.ENV_LIB_DIR} to a build's lib/ directory)")
  return platform, ""


def _resolve_transfer(transfer: Any, sharding: Any, size: int,
                      func: str) -> _Transfer:
  if not isinstance(transfer, str) or transfer not in TRANSFERS:
    raise ValueError(f"{func}: transfer must be one of {list(TRANSFERS)}, got "
                     f"{transfer!r}")
  if transfer == "auto":
    transfer = AUTO_TRANSFER.get(jax.default_backend(), "device_put")
    if transfer == "stage_area" and _stage_platform(sharding)[0] is None:
      transfer = "device_put"
  if transfer == "device_put":
    return _DevicePutTransfer(sharding)
  platform, why_not = _stage_platform(sharding)
  if platform is None:
    raise ValueError(f"{func}: transfer='stage_area' cannot be used here: "
                     f"{why_not}. Use transfer='device_put' or 'auto'.")
  return _StageAreaTransfer(size, platform)


def prefetch(iterable: Iterable[Any], size: int = 2, *, sharding: Any = None,
             num_threads: int = 1, timeout: float | None = None,
             closed_exception_types: Any = (StopIteration,),
             ignored_exception_types: Any = (),
             transfer: str = "auto", mode: str = "auto") -> Prefetcher:
  """An iterator over ``iterable``'s items, placed on the device ahead of use.

  Args:
    iterable: yields pytrees of host arrays (numpy arrays, scalars, or
      arrays already on a device).
    size: how many items may be pulled ahead of the consumer (>= 1). Memory
      is bounded by ``size`` items: a worker pulls item ``k + size`` only once
      the consumer has received item ``k``.
    sharding: where items go, as for ``jax.device_put``: None (the default
      device), a ``jax.Device``, a ``jax.sharding.Sharding``, or a pytree of
      them matching the items.
    num_threads: worker threads. Pulls from the iterable are one at a time
      (iterators are not thread-safe); placement runs in parallel. Items come
      out in the iterable's order whatever the number of threads.
    timeout: seconds the consumer waits for one item before ``TimeoutError``
      (None: no bound). The iterator stays usable after a timeout.
    closed_exception_types: exceptions that end the iteration cleanly when
      raised for an item (``StopIteration`` from the iterable always does).
    ignored_exception_types: exceptions that skip the item they were raised
      for; iteration continues with the next one.
    transfer: how items reach the device.

      * ``"device_put"``: ``jax.device_put`` in the worker, which waits until
        the copy is done.
      * ``"stage_area"``: the runtime's ``StageArea`` with ``size`` slots (on
        a GPU: pinned host slots, copies on the runtime's copy stream, a
        ready event per slot; on CPU: the CPU runtime's slots). The first
        item whose leaves are all numpy arrays fixes the structure, shapes
        and dtypes; an item that does not fit them, or has a leaf that is
        not a numpy array (a Python scalar, an array already on a device),
        is placed with ``jax.device_put`` instead, in its place in the order
        (``Prefetcher.placed`` counts both). Items go to jax's default
        device: with a ``sharding``, ``"stage_area"`` raises ValueError.
        Each iterator compiles one small program for its area's gets.
      * ``"auto"`` (default): the path ``benchmarks/prefetch.py`` measured
        faster on this backend (``AUTO_TRANSFER``). On CPU that is
        ``"device_put"`` (the stage area adds host copies there and moves no
        data to another memory). On a GPU it is ``"device_put"`` too: the
        stage-area path has not been measured on a GPU by this project yet,
        and ``"auto"`` will pick it only once a measurement supports it.
        ``"device_put"`` also whenever ``"stage_area"`` cannot be used (a
        ``sharding`` given, no runtime library for the backend).

      Both paths hand out the same arrays, bit for bit, with the same dtypes.
    mode: who produces the items (pulls them from the iterable and places
      them).

      * ``"auto"`` (default): worker threads only where they pay. Items are
        produced in the consumer's thread, at ``next()``, as a plain loop
        would, until the iterator's own measurements say producing one is
        worth hiding: it then moves to workers (at once when production is
        half a cycle or more, else after a trial that times cycles with and
        without them), and steps aside again when production becomes cheap.
        One ``jaxstreams.PerformanceWarning`` the first time it decides to
        step aside. With a ``timeout``, always workers (only a wait for
        another thread can time out).
      * ``"workers"``: always worker threads.
      * ``"inline"``: always the consumer's thread (no thread is started;
        no ``timeout``).

      ``Prefetcher.stats()`` says which way it runs and why.

  Any other exception raised for item ``k`` is raised by ``next()`` after
  items ``< k`` were delivered, and ends the iteration.

  Returns a ``Prefetcher``: an iterator and a context manager with
  ``close()``. Workers stop at the end, on ``close()``, on leaving the
  ``with`` block, or when the iterator is garbage-collected; a stage area is
  destroyed then (once the gets already dispatched have run).
  """
  func = "jaxstreams.prefetch"
  size = _positive_int(size, "size", func)
  num_threads = _positive_int(num_threads, "num_threads", func)
  if num_threads > MAX_THREADS:
    raise ValueError(f"{func}: num_threads must be <= {MAX_THREADS} (one "
                     f"thread each; at most size={size} items are placed at "
                     f"once), got {num_threads}")
  timeout = _checks.timeout(timeout, name="timeout", context=func)
  closed = _exception_types(closed_exception_types, "closed_exception_types")
  ignored = _exception_types(ignored_exception_types, "ignored_exception_types")
  both = set(closed) & set(ignored)
  if both:
    raise ValueError(f"{func}: {sorted(t.__name__ for t in both)} are in both "
                     "closed_exception_types and ignored_exception_types; an "
                     "exception either ends the iteration or skips an item")
  _check_sharding(sharding)
  _checks.one_of(mode, MODES, name="mode", context=func)
  if mode == "inline" and timeout is not None:
    raise ValueError(f"{func}: mode='inline' cannot honour timeout={timeout}: "
                     f"the consumer's own thread produces each item, and "
                     f"nothing can interrupt it. Use mode='workers' or "
                     f"'auto' with a timeout, or no timeout.")
  placer = _resolve_transfer(transfer, sharding, size, func)
  return Prefetcher(iterable, size, transfer=placer,
                    num_threads=num_threads, timeout=timeout,
                    closed_exception_types=closed,
                    ignored_exception_types=ignored, warn=True, mode=mode)
