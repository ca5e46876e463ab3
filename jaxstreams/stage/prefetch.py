"""``jaxstreams.prefetch``: a host iterator whose items are on the device
before the consumer asks for them.

Why threads: the work that stalls a training loop between steps is host work
(reading, parsing, hashing) and the host-to-device copy. JAX's async dispatch
hides neither of them from a loop that does them in the same thread, which is
what ``flax.jax_utils.prefetch_to_device`` does (it only issues the copies
early). Here worker threads pull items from the iterable and place them with
``jax.device_put`` while the consumer's step runs; the GIL is released while
a producer waits on I/O and while XLA copies or computes, so they overlap.

The pipeline, and the guarantees it keeps:

* **Bounded lookahead.** A worker takes a *slot* before it pulls an item from
  the iterable; the consumer gives the slot back when it receives that item.
  With ``size`` slots, at most ``size`` items have been pulled and not yet
  delivered, so memory is ``size`` items whatever the speed of either side.
* **Order.** Pulls from the iterable are serialised (iterators are not
  thread-safe) and numbered; results are delivered by number, so the order is
  the iterable's even when ``num_threads > 1`` workers place items at once.
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

* ``"device_put"``: the worker calls ``jax.device_put`` and waits until the
  copy is done, so an item handed out is on the device.
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
import threading
import time
import types
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

import jax
import numpy as np

from jaxstreams import _checks
from jaxstreams._performance import PerformanceWarning

__all__ = ["prefetch", "Prefetcher", "TRANSFERS", "AUTO_TRANSFER"]

_names = itertools.count()

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


# Whether prefetching pays, judged from the iterator's own counters.
# benchmarks/prefetch_sweep.py measured prefetch 15-80% slower than the plain
# loop on CPU for steps under a millisecond whose data was free to produce:
# the overlap then hides almost nothing, and the hand-off and a worker thread
# competing for the CPU cost more than that. Judged only after enough items,
# and only "does not pay" when clearly so: the consumer almost never waited
# (the items were there anyway) and the work moved off its thread is a small
# share of a step.
MIN_ITEMS_TO_JUDGE = 100
MOSTLY_READY = 0.05       # the consumer waited for at most this share of items
SMALL_SHARE = 0.05        # the most prefetching could save, as a share of a step


class _Counters:
  """What the pipeline counts for ``Prefetcher.stats()`` (seconds, summed
  over the items delivered)."""
  __slots__ = ("items", "waited", "wait_s", "handoff_s", "produce_s", "step_s")

  def __init__(self):
    self.items = 0          # values delivered to the consumer
    self.waited = 0         # of them, how many the consumer had to wait for
    self.wait_s = 0.0       # the consumer's time waiting for items
    self.handoff_s = 0.0    # the consumer's time in next() besides waiting
    self.produce_s = 0.0    # workers' time pulling and placing items
    self.step_s = 0.0       # the consumer's time between next() calls


def judge(items: int, waited: int, wait_s: float, handoff_s: float,
          produce_s: float, step_s: float) -> tuple[bool | None, str]:
  """Whether prefetching pays, from a prefetcher's counters: (True, why),
  (False, why), or (None, why) before ``MIN_ITEMS_TO_JUDGE`` items.

  Without prefetching the consumer would pull and place each item itself
  (``produce_s``); with it, it pays the hand-off (``handoff_s``) and any
  wait. When it almost never waited, the most prefetching can save per item
  is the production time less the hand-off; when that is a small share of a
  step, prefetching cannot pay (and its thread competes for the CPU)."""
  if items < MIN_ITEMS_TO_JUDGE:
    return None, (f"not judged before {MIN_ITEMS_TO_JUDGE} items "
                  f"({items} so far)")
  us = 1e6 / items
  produce, handoff, step = produce_s * us, handoff_s * us, step_s * us
  wait = wait_s * us
  if waited > MOSTLY_READY * items:
    return True, (f"the consumer waited for {waited} of {items} items "
                  f"({wait:.0f} us per item on average): producing one "
                  f"({produce:.0f} us) is what limits the loop, and the "
                  f"overlap hides it behind the step ({step:.0f} us)")
  saved = produce - handoff
  cycle = step + handoff + wait
  if saved <= SMALL_SHARE * cycle:
    return False, (
        f"the consumer waited for only {waited} of {items} items, so they "
        f"were ready anyway: producing an item takes {produce:.0f} us, "
        f"handing it over {handoff:.0f} us, a step {step:.0f} us, so "
        f"prefetching saves at most {max(saved, 0.0) / cycle:.1%} of a step "
        f"while its worker thread competes for the CPU; iterating the data "
        f"directly is likely as fast or faster")
  return True, (f"producing an item ({produce:.0f} us) costs more than "
                f"handing it over ({handoff:.0f} us): prefetching saves up to "
                f"{saved / cycle:.1%} of a step")


class _Pipeline:
  """State shared by the workers and the consumer (never the public object,
  so that the public iterator can be garbage-collected while workers run)."""

  def __init__(self, iterator: Iterator[Any], transfer: _Transfer,
               size: int, num_threads: int, closed: tuple, ignored: tuple,
               description: str, name: str):
    self.iterator = iterator
    self.transfer = transfer
    self.size = size
    self.closed_types = closed
    self.ignored_types = ignored
    self.description = description
    self.cond = threading.Condition(threading.RLock())
    self.free_slots = size
    self.next_pull = 0          # number of the next item to pull
    self.next_out = 0           # number of the next item to deliver
    self.results: dict[int, tuple[str, Any]] = {}
    self.source_done = False    # no more pulls: end, error or stop
    self.stopped = False
    self.pulling = False        # a worker is inside next(iterator)
    self.max_in_flight = 0      # pulled but not yet delivered (for tests)
    self.next_ticket = 0        # order of the items handed to the transfer
    self.live_workers = 0       # started and not yet returned
    self.released = False       # the transfer's resources were freed
    self.close_owned_on_exit = False   # close() stopped waiting for workers
    self.counters = _Counters()        # for stats(), under self.cond
    self.last_delivery = None          # perf_counter() when an item went out
    self.threads = []
    try:
      for i in range(num_threads):
        thread = threading.Thread(target=self._work, name=f"{name}-worker{i}",
                                  daemon=True)
        with self.cond:
          self.live_workers += 1
        try:
          thread.start()
        except BaseException:
          with self.cond:
            self.live_workers -= 1
          raise
        self.threads.append(thread)
    except BaseException:
      self.stop(join=True)    # no half-started pipeline keeps its workers
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
      with self.cond:
        self.live_workers -= 1
        close_owned = self.live_workers == 0 and self.close_owned_on_exit
      self._release_if_idle()
      if close_owned:           # close(timeout) gave up waiting for us
        self._close_owned()

  def _work_loop(self) -> None:
    while True:
      with self.cond:
        # A slot, and the right to pull (pulls are serialised to keep order).
        while not self.stopped and not self.source_done and (
            self.free_slots == 0 or self.pulling):
          self.cond.wait()
        if self.stopped or self.source_done:
          return
        self.free_slots -= 1
        self.pulling = True
        number = self.next_pull
        self.next_pull += 1
        self.max_in_flight = max(self.max_in_flight,
                                 self.next_pull - self.next_out)
      started = time.perf_counter()
      try:
        item = next(self.iterator)
        kind = _VALUE
      except StopIteration:
        kind, item = _END, None
      except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
        kind, item = self._classify(exc), exc
      with self.cond:
        self.pulling = False
        if kind in (_END, _ERROR):
          self.source_done = True   # nothing is pulled past an end or failure
        if kind == _VALUE:
          # Tickets follow pull order: the transfer may need to place items
          # in order (a stage area is a FIFO) while threads place at once.
          ticket = self.next_ticket
          self.next_ticket += 1
        self.cond.notify_all()
        if self.stopped:
          return                    # closed while pulling: deliver nothing
      if kind == _VALUE:
        try:
          item = self.transfer.place(ticket, item)
        except BaseException as exc:  # noqa: BLE001
          kind, item = self._classify(exc), exc
          if kind in (_END, _ERROR):
            with self.cond:
              self.source_done = True
      produced = time.perf_counter() - started
      with self.cond:
        if self.stopped:
          return                    # closed meanwhile: nothing is handed out
        if kind == _VALUE:
          self.counters.produce_s += produced
        self.results[number] = (kind, item)
        self.cond.notify_all()

  # Consumer ------------------------------------------------------------------
  def get(self, timeout: float | None, wait: bool = True) -> Any:
    """The next item in order; raises its exception, StopIteration at the
    end, TimeoutError when it is not ready within ``timeout`` seconds. With
    ``wait=False``, returns NOT_READY at once instead of waiting."""
    entered = time.perf_counter()
    waited_s = 0.0
    with self.cond:
      while True:
        number = self.next_out
        if self.stopped and number not in self.results:
          raise StopIteration
        if not wait and number not in self.results:
          return NOT_READY
        if number not in self.results:
          wait_started = time.perf_counter()
          ready = self.cond.wait_for(
              lambda: number in self.results or self.stopped, timeout)
          waited_s += time.perf_counter() - wait_started
        else:
          ready = True
        if not ready:
          busy = "inside the iterable's __next__" if self.pulling else \
              "placing it on the device"
          raise TimeoutError(
              f"jaxstreams.prefetch: waited more than {timeout} s for item "
              f"{number} of {self.description} (a worker is {busy}; "
              f"{self.next_out} item(s) delivered so far)")
        if number not in self.results:
          raise StopIteration
        kind, value = self.results.pop(number)
        self.next_out += 1
        self.free_slots += 1
        self.cond.notify_all()
        if kind == _VALUE:
          # Under the lock: takes from a stage area happen in item order
          # even if several threads call next() at once.
          out = self.transfer.deliver(value)
          self._count_delivery(entered, waited_s)
          return out
        if kind == _SKIP:
          continue
        self.stopped = True     # end or failure: nothing more to deliver
        self.results.clear()
        self.cond.notify_all()
        if kind == _END:
          raise StopIteration
        raise value

  def _count_delivery(self, entered: float, waited_s: float) -> None:
    """Adds one delivered item to the counters (under self.cond)."""
    now = time.perf_counter()
    c = self.counters
    c.items += 1
    if waited_s > 0:
      c.waited += 1
      c.wait_s += waited_s
    c.handoff_s += now - entered - waited_s
    if self.last_delivery is not None:
      c.step_s += entered - self.last_delivery
    self.last_delivery = now

  def stop(self, join: bool, timeout: float | None = None) -> bool:
    """Ends the workers; with ``join``, waits for them up to ``timeout``
    seconds (a worker inside the iterable's ``__next__`` can only stop once
    that call returns). Returns whether every worker has ended; when one has
    not, the last worker to return frees what the pipeline owns.

    When the iterable is another prefetch pipeline (a staged step's chain of
    stages), it is stopped first, so a worker waiting on it wakes up."""
    with self.cond:
      self.stopped = True
      self.results.clear()
      self.cond.notify_all()
    self.transfer.stop()        # wakes a worker waiting in a stage put
    upstream = self.iterator
    if isinstance(upstream, Prefetcher):
      upstream._pipeline.stop(join=False)
    if not join:
      self._release_if_idle()   # or the last worker does, when it returns
      return False
    deadline = None if timeout is None else time.monotonic() + timeout
    current = threading.current_thread()
    for thread in self.threads:
      if thread is not current:
        thread.join(None if deadline is None else
                    max(0.0, deadline - time.monotonic()))
    self._release_if_idle()
    with self.cond:
      if self.live_workers > 0:
        self.close_owned_on_exit = True   # the last worker closes them
        return False
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
    with self.cond:
      if not self.stopped or self.live_workers > 0 or self.released:
        return
      self.released = True
    self.transfer.release()


def next_if_ready(prefetcher: Prefetcher) -> Any:
  """The prefetcher's next item if it is ready now, else ``NOT_READY``: no
  waiting and no exception to build. Package-internal, for ``staged``'s
  fused runner, which polls its reader every call and must never wait for a
  batch the reader has not finished; the end and item errors are raised as
  by ``next``."""
  return prefetcher._get(wait=False)


def _stop_unjoined(pipeline: _Pipeline) -> None:
  # Run by weakref.finalize at collection time: it may run on any thread,
  # even a worker, so it only signals.
  pipeline.stop(join=False)


class Prefetcher:
  """The iterator ``jaxstreams.prefetch`` returns; see there.

  Iterate it, or use it as a context manager; ``close()`` stops the workers
  and waits for them. Attributes: ``size``, ``num_threads``, ``timeout``.
  """

  def __init__(self, iterable: Iterable[Any], size: int, *,
               transform: Callable[[Any], Any] | None = None, num_threads: int,
               timeout: float | None, closed_exception_types: tuple,
               ignored_exception_types: tuple, func: str = "jaxstreams.prefetch",
               transfer: _Transfer | None = None, warn: bool = False):
    if (transform is None) == (transfer is None):
      raise TypeError(f"{func}: give exactly one of transform and transfer")
    if transfer is None:
      transfer = _FunctionTransfer(transform)
    self.transfer = transfer.name
    self.size = size
    self.num_threads = num_threads
    self.timeout = timeout
    try:
      iterator = iter(iterable)
    except TypeError:
      transfer.release()
      raise TypeError(f"{func}: iterable must be iterable, got {iterable!r} "
                      f"of type {type(iterable).__name__}") from None
    name = f"jaxstreams-prefetch-{next(_names)}"
    self._transfer = transfer
    self._closed = False
    # Only the public prefetch() warns: a staged step's internal pipelines
    # are its own business.
    self._warn = warn
    self._pipeline = _Pipeline(
        iterator, transfer, size, num_threads,
        closed_exception_types, ignored_exception_types,
        _describe(iterable), name)
    self._finalizer = weakref.finalize(self, _stop_unjoined, self._pipeline)

  def __iter__(self) -> Prefetcher:
    return self

  def __next__(self) -> Any:
    return self._get(wait=True)

  def _get(self, wait: bool) -> Any:
    try:
      item = self._pipeline.get(self.timeout, wait)
      if self._warn:
        self._warn_if_not_paying()
      return item
    except TimeoutError:
      raise             # the item may still come: stay usable
    except BaseException:
      if not self._closed:   # after close(timeout) gave up: do not wait now
        self.close()    # the end, or item k's exception: nothing follows
      raise

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
    """Whether prefetching pays here, from this iterator's own counters:
    ``items`` delivered, ``waited`` (how many the consumer had to wait for),
    ``wait_us``, ``handoff_us``, ``produce_us`` and ``step_us`` per item (the
    consumer's time waiting, in ``next()`` besides waiting, the workers' time
    pulling and placing an item, the consumer's time between ``next()``
    calls), and ``pays`` (True, False, or None before
    ``MIN_ITEMS_TO_JUDGE`` items) with its ``reason``."""
    with self._pipeline.cond:
      c = self._pipeline.counters
      counts = (c.items, c.waited, c.wait_s, c.handoff_s, c.produce_s,
                c.step_s)
    items = counts[0]
    pays, reason = judge(*counts)
    per_item = 1e6 / max(items, 1)
    return {"items": items, "waited": counts[1],
            "wait_us": counts[2] * per_item,
            "handoff_us": counts[3] * per_item,
            "produce_us": counts[4] * per_item,
            "step_us": counts[5] * per_item,
            "pays": pays, "reason": reason}

  def _warn_if_not_paying(self) -> None:
    """Once per iterator, at every ``MIN_ITEMS_TO_JUDGE``-th item: a
    ``PerformanceWarning`` when the counters say prefetching does not pay."""
    with self._pipeline.cond:
      c = self._pipeline.counters
      if c.items % MIN_ITEMS_TO_JUDGE:
        return
      counts = (c.items, c.waited, c.wait_s, c.handoff_s, c.produce_s,
                c.step_s)
    pays, reason = judge(*counts)
    if pays is False:
      self._warn = False
      warnings.warn(f"jaxstreams.prefetch does not pay here: {reason} "
                    f"(Prefetcher.stats() has the figures; filter "
                    f"jaxstreams.PerformanceWarning to silence this)",
                    PerformanceWarning, stacklevel=4)

  @property
  def max_in_flight(self) -> int:
    """Most items ever pulled from the iterable and not yet delivered
    (at most ``size``: the lookahead bound, exposed for tests)."""
    return self._pipeline.max_in_flight

  @property
  def threads(self) -> list[threading.Thread]:
    return list(self._pipeline.threads)

  @property
  def placed(self) -> dict[str, int]:
    """How many items each path placed so far: ``{"device_put": n,
    "stage_area": m}`` (with ``transfer="stage_area"``, ``device_put``
    counts the items that did not fit the stage area)."""
    return self._transfer.counts()

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
            f"transfer={self.transfer!r}>")


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
  """How a worker places an item and how the consumer receives it.

  ``place(ticket, item)`` runs in a worker (tickets are 0, 1, 2... in pull
  order, one per item pulled); ``deliver(value)`` runs in the consumer, under
  the pipeline's lock, in item order, with what ``place`` returned; ``stop()``
  may run on any thread and only signals; ``release()`` runs once, when no
  worker is left and nothing more will be delivered."""

  name = "custom"

  def place(self, ticket: int, item: Any) -> Any:
    raise NotImplementedError

  def deliver(self, value: Any) -> Any:
    return value

  def stop(self) -> None:
    pass

  def release(self) -> None:
    pass

  def counts(self) -> dict[str, int]:
    return {}


class _FunctionTransfer(_Transfer):
  """A plain function of the item (``Prefetcher(transform=...)``)."""

  def __init__(self, transform: Callable[[Any], Any]):
    self.transform = transform

  def place(self, ticket: int, item: Any) -> Any:
    return self.transform(item)


# A jitted identity copies numpy leaves onto the default device through
# jit's C++ argument path: on jax 0.10.2 / XLA:CPU about 20 us for a small
# array where jax.device_put takes about 90 us (measured on a shared 2-core
# machine). That difference is most of a worker's per-item cost, which a
# step under a millisecond pays in full when it reads its result every step.
_copy_to_device = jax.jit(lambda tree: tree)


# The identity compiles once per item signature: worth it only for a
# signature that repeats. The first item of a signature goes through
# jax.device_put; from its second on, through the copy. Bounded, so a stream
# of ever new shapes costs no more than jax.device_put.
_SEEN_SIGNATURES_MAX = 256
_seen_signatures: set = set()


def _copies_cheaply(item: Any) -> bool:
  leaves, treedef = jax.tree_util.tree_flatten(item)
  if not leaves or any(type(leaf) is not np.ndarray for leaf in leaves):
    return False
  key = (treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves))
  if key in _seen_signatures:
    return True
  if len(_seen_signatures) < _SEEN_SIGNATURES_MAX:
    _seen_signatures.add(key)
  return False


def _device_put_now(item: Any, sharding: Any) -> Any:
  # Waiting here, in the worker, means an item handed out is really on the
  # device, and the lookahead bound counts real device memory.
  if sharding is None and _copies_cheaply(item):
    # The same arrays jax.device_put(item) gives (dtypes canonicalized the
    # same way), copied, so the producer may reuse its numpy buffers.
    return jax.block_until_ready(_copy_to_device(item))
  return jax.block_until_ready(jax.device_put(item, sharding))


class _DevicePutTransfer(_Transfer):
  name = "device_put"

  def __init__(self, sharding: Any):
    self.sharding = sharding
    self.lock = threading.Lock()
    self.placed = 0

  def place(self, ticket: int, item: Any) -> Any:
    out = _device_put_now(item, self.sharding)
    with self.lock:
      self.placed += 1
    return out

  def counts(self) -> dict[str, int]:
    return {"device_put": self.placed, "stage_area": 0}


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
    if dtype.kind not in "biufc" and dtype.name not in _EXTRA_DTYPES:
      return None
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
  def place(self, ticket: int, item: Any) -> Any:
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
    out = _device_put_now(item, None)
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

  def counts(self) -> dict[str, int]:
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
             transfer: str = "auto") -> Prefetcher:
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
  placer = _resolve_transfer(transfer, sharding, size, func)
  return Prefetcher(iterable, size, transfer=placer,
                    num_threads=num_threads, timeout=timeout,
                    closed_exception_types=closed,
                    ignored_exception_types=ignored, warn=True)
