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
"""

from __future__ import annotations

import itertools
import math
import threading
import types
import weakref
from typing import Any, Callable, Iterable, Iterator

import jax

from jaxstreams import _checks

__all__ = ["prefetch", "Prefetcher"]

_names = itertools.count()

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


def _timeout(value: Any, func: str) -> float | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{func}: timeout must be a number of seconds > 0 or None, "
                    f"got {value!r} of type {type(value).__name__}")
  if not value > 0:
    raise ValueError(f"{func}: timeout must be > 0 seconds or None, got "
                     f"{value!r}")
  if math.isinf(value):
    return None       # no bound (threading cannot wait an infinite time)
  return float(value)


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
  text = repr(iterable)
  return text if len(text) <= 80 else text[:77] + "..."


class _Pipeline:
  """State shared by the workers and the consumer (never the public object,
  so that the public iterator can be garbage-collected while workers run)."""

  def __init__(self, iterator: Iterator[Any], transform: Callable[[Any], Any],
               size: int, num_threads: int, closed: tuple, ignored: tuple,
               description: str, name: str):
    self.iterator = iterator
    self.transform = transform
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
    self.threads = []
    try:
      for i in range(num_threads):
        thread = threading.Thread(target=self._work, name=f"{name}-worker{i}",
                                  daemon=True)
        thread.start()
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
        self.cond.notify_all()
        if self.stopped:
          return                    # closed while pulling: deliver nothing
      if kind == _VALUE:
        try:
          item = self.transform(item)
        except BaseException as exc:  # noqa: BLE001
          kind, item = self._classify(exc), exc
          if kind in (_END, _ERROR):
            with self.cond:
              self.source_done = True
      with self.cond:
        if self.stopped:
          return                    # closed meanwhile: nothing is handed out
        self.results[number] = (kind, item)
        self.cond.notify_all()

  # Consumer ------------------------------------------------------------------
  def get(self, timeout: float | None) -> Any:
    """The next item in order; raises its exception, StopIteration at the
    end, TimeoutError when it is not ready within ``timeout`` seconds."""
    with self.cond:
      while True:
        number = self.next_out
        if self.stopped and number not in self.results:
          raise StopIteration
        if not self.cond.wait_for(
            lambda: number in self.results or self.stopped, timeout):
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
          return value
        if kind == _SKIP:
          continue
        self.stopped = True     # end or failure: nothing more to deliver
        self.results.clear()
        self.cond.notify_all()
        if kind == _END:
          raise StopIteration
        raise value

  def stop(self, join: bool) -> None:
    """Ends the workers; with ``join``, waits for them (a worker inside the
    iterable's ``__next__`` can only stop once that call returns).

    When the iterable is another prefetch pipeline (a staged step's chain of
    stages), it is stopped first, so a worker waiting on it wakes up."""
    with self.cond:
      self.stopped = True
      self.results.clear()
      self.cond.notify_all()
    upstream = self.iterator
    if isinstance(upstream, Prefetcher):
      upstream._pipeline.stop(join=False)
    if not join:
      return
    current = threading.current_thread()
    for thread in self.threads:
      if thread is not current:
        thread.join()
    if any(t.is_alive() for t in self.threads):
      return
    # Close what we own: an upstream pipeline (joins its workers) and a
    # generator (its finally blocks run now, not at interpreter exit). Other
    # iterators (a file the caller opened) are the caller's to close.
    if isinstance(upstream, (Prefetcher, types.GeneratorType)):
      try:
        upstream.close()
      except Exception:  # noqa: BLE001 - closing is best effort
        pass


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
               transform: Callable[[Any], Any], num_threads: int,
               timeout: float | None, closed_exception_types: tuple,
               ignored_exception_types: tuple, func: str = "jaxstreams.prefetch"):
    self.size = size
    self.num_threads = num_threads
    self.timeout = timeout
    try:
      iterator = iter(iterable)
    except TypeError:
      raise TypeError(f"{func}: iterable must be iterable, got {iterable!r} "
                      f"of type {type(iterable).__name__}") from None
    name = f"jaxstreams-prefetch-{next(_names)}"
    self._pipeline = _Pipeline(
        iterator, transform, size, num_threads,
        closed_exception_types, ignored_exception_types,
        _describe(iterable), name)
    self._finalizer = weakref.finalize(self, _stop_unjoined, self._pipeline)

  def __iter__(self) -> Prefetcher:
    return self

  def __next__(self) -> Any:
    try:
      return self._pipeline.get(self.timeout)
    except TimeoutError:
      raise             # the item may still come: stay usable
    except BaseException:
      self.close()      # the end, or item k's exception: nothing follows
      raise

  def close(self) -> None:
    """Stops the workers and waits for them to exit; idempotent."""
    self._finalizer.detach()
    self._pipeline.stop(join=True)

  @property
  def max_in_flight(self) -> int:
    """Most items ever pulled from the iterable and not yet delivered
    (at most ``size``: the lookahead bound, exposed for tests)."""
    return self._pipeline.max_in_flight

  @property
  def threads(self) -> list[threading.Thread]:
    return list(self._pipeline.threads)

  def __enter__(self) -> Prefetcher:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def __repr__(self) -> str:
    return (f"<jaxstreams.prefetch of {self._pipeline.description}, "
            f"size={self.size}, num_threads={self.num_threads}>")


def _device_put(sharding: Any) -> Callable[[Any], Any]:
  def place(item: Any) -> Any:
    # Waiting here, in the worker, means an item handed out is really on the
    # device, and the lookahead bound counts real device memory.
    return jax.block_until_ready(jax.device_put(item, sharding))
  return place


def prefetch(iterable: Iterable[Any], size: int = 2, *, sharding: Any = None,
             num_threads: int = 1, timeout: float | None = None,
             closed_exception_types: Any = (StopIteration,),
             ignored_exception_types: Any = ()) -> Prefetcher:
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

  Any other exception raised for item ``k`` is raised by ``next()`` after
  items ``< k`` were delivered, and ends the iteration.

  Returns a ``Prefetcher``: an iterator and a context manager with
  ``close()``. Workers stop at the end, on ``close()``, on leaving the
  ``with`` block, or when the iterator is garbage-collected.
  """
  func = "jaxstreams.prefetch"
  size = _positive_int(size, "size", func)
  num_threads = _positive_int(num_threads, "num_threads", func)
  if num_threads > MAX_THREADS:
    raise ValueError(f"{func}: num_threads must be <= {MAX_THREADS} (one "
                     f"thread each; at most size={size} items are placed at "
                     f"once), got {num_threads}")
  timeout = _timeout(timeout, func)
  closed = _exception_types(closed_exception_types, "closed_exception_types")
  ignored = _exception_types(ignored_exception_types, "ignored_exception_types")
  both = set(closed) & set(ignored)
  if both:
    raise ValueError(f"{func}: {sorted(t.__name__ for t in both)} are in both "
                     "closed_exception_types and ignored_exception_types; an "
                     "exception either ends the iteration or skips an item")
  _check_sharding(sharding)
  return Prefetcher(iterable, size, transform=_device_put(sharding),
                    num_threads=num_threads, timeout=timeout,
                    closed_exception_types=closed,
                    ignored_exception_types=ignored)
