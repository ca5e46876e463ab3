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
is nothing for it to hide: a loop of sub-millisecond steps that reads
each result ran at 0.2x-0.85x of the plain loop with one while the
consumer woke it every other item at ``size=2``, and one that does not
read each result still runs at 0.87x-0.95x now that workers poll. So by
default (``mode="measured"``) the consumer's own thread produces each item
at ``next()`` (*inline*: pull, then place, as the plain loop would) until
the iterator's measurements of itself say producing one is worth hiding
(``_chooser``); then workers take over, and they step aside again when
production turns cheap. One exception, found by trials: on XLA:CPU with
asynchronous dispatch, the consumer's own time between short steps costs
more than it takes, and a worker (which polls for a free slot rather than
be woken from there) can take the placement out of it: ``mode="measured"``
tries workers there at short cycles. ``mode="workers"`` / ``"inline"``
force one way; ``stats()`` says which way it runs and why.

Where each piece lives: ``_prefetch_checks`` (the arguments),
``_lookahead`` (the pipeline: workers or the consumer's thread, its
guarantees), ``_chooser`` (whether workers pay), ``_transfer`` (how items
reach the device). This module is the public iterator and ``prefetch()``.
"""

from __future__ import annotations

import itertools
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterable

from jaxstreams import _checks, _compat
from jaxstreams._performance import PerformanceWarning
from jaxstreams.staging import _prefetch_checks, _transfer
from jaxstreams.staging._chooser import SHORT_CYCLE_US
from jaxstreams.staging._lookahead import Pipeline
from jaxstreams.staging._prefetch_checks import FUNC
from jaxstreams.staging._transfer import FunctionTransfer, Transfer

_names = itertools.count()


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


def next_if_ready(prefetcher: Prefetcher) -> Any:
  """The prefetcher's next item if it is ready now, else ``NOT_READY``: no
  waiting for a worker and no exception to build. Package-internal, for
  ``staged``'s fused runner, which polls its reader every call and must
  never wait for a batch the reader has not finished; the end and item
  errors are raised as by ``next``. (Where items are produced inline, the
  item is produced now, in the calling thread: staged's reader keeps its
  workers.)"""
  return prefetcher._get(wait=False)


def set_way(prefetcher: Prefetcher, way: str) -> None:
  """Who produces the prefetcher's items from now on: ``"workers"``, or
  ``"inline"`` (its workers park). Package-internal, for ``staged``'s
  reader, whose runner decides (``mode="measured"``) and reads the iterable in
  its own thread while the reader's workers are parked and
  ``holds_items`` is false."""
  pipeline = prefetcher._pipeline
  with pipeline.lock:
    if not pipeline.stopped:
      pipeline.set_mode(way)


def holds_items(prefetcher: Prefetcher) -> bool:
  """Whether the prefetcher has pulled (or is pulling) an item it has not
  delivered yet: ``next()`` delivers that one, in order, before any other
  pull. Package-internal, with ``set_way``."""
  pipeline = prefetcher._pipeline
  with pipeline.lock:
    return not pipeline.stopped and pipeline.next_out < pipeline.next_pull


def _stop_unjoined(pipeline: Pipeline) -> None:
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
               transfer: Transfer | None = None, warn: bool = False,
               mode: str = "workers"):
    if (transform is None) == (transfer is None):
      raise TypeError(f"{func}: give exactly one of transform and transfer")
    if transfer is None:
      transfer = FunctionTransfer(transform)
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
    if mode == "measured" and timeout is not None:
      # A wait can only time out on an item another thread produces.
      mode, reason = "workers", (
          f"workers produce the items: timeout={timeout} was given, and "
          f"only a wait for a worker can time out")
    name = f"jaxstreams-prefetch-{next(_names)}"
    shares_cores = mode == "measured" and transfer.shares_cores()
    # Where the consumer's own time between short steps costs a step more
    # than it takes (XLA:CPU, asynchronous dispatch): mode="measured" may try
    # workers for it, and the step-aside warning says so.
    self._dispatch_gap = shares_cores and _compat.cpu_dispatch_is_async()
    self._transfer = transfer
    self._closed = False
    # Only the public prefetch() warns: a staged step's internal pipelines
    # are its own business.
    self._warn = warn
    upstream = iterator._pipeline if isinstance(iterator, Prefetcher) else None
    owned = (iterator if isinstance(iterator, (Prefetcher, types.GeneratorType))
             else None)    # a file the caller opened is the caller's to close
    self._pipeline = Pipeline(
        iterator, transfer, size, num_threads,
        closed_exception_types, ignored_exception_types,
        _describe(iterable), name, mode, reason, upstream=upstream,
        owned=owned, shares_cores=shares_cores,
        unseen_gain=self._dispatch_gap)
    self._finalizer = weakref.finalize(self, _stop_unjoined, self._pipeline)

  def __iter__(self) -> Prefetcher:
    return self

  def _get(self, wait: bool = True) -> Any:
    pipeline = self._pipeline
    try:
      item = pipeline.get(self.timeout, wait)
    except TimeoutError:
      raise             # the item may still come: stay usable
    except BaseException:
      if not self._closed:   # after close(timeout) gave up: do not wait now
        self.close()    # the end, or item k's exception: nothing follows
      raise
    if pipeline.meter.news is not None:
      self._tell()
    return item

  # One call per item, not two (see Pipeline.get's ready item).
  __next__ = _get

  def _tell(self) -> None:
    """The one ``PerformanceWarning``: prefetching stepped aside."""
    meter = self._pipeline.meter
    news, meter.news = meter.news, None
    if self._warn and news:
      cycle_us = meter.news_cycle * 1e6     # what the chooser judged on
      short = ""
      if 0 < cycle_us < SHORT_CYCLE_US:
        short = (f"; with cycles this short ({cycle_us:.0f} us), even "
                 f"placing each item from Python at next() costs several "
                 f"percent: iterating the source directly, and letting the "
                 f"jitted step take its numpy arrays, costs least")
        if self._dispatch_gap:
          short += (" (on CPU with asynchronous dispatch, a step started "
                    "more than a few microseconds after the previous "
                    "result was read costs up to about 20 us more; "
                    "mode='measured' tries workers at such cycles, which "
                    "keep the placement off this thread, and keeps them "
                    "where a trial finds them faster; in a loop that reads "
                    "each result, jax_cpu_enable_async_dispatch=False "
                    "avoids most of that)")
      warnings.warn(
          f"jaxstreams.prefetch does not pay here and stepped aside: {news}"
          f"{short} (Prefetcher.stats() has the figures; "
          f"prefetch(mode='workers') keeps worker threads; filter "
          f"jaxstreams.PerformanceWarning to silence this)",
          PerformanceWarning, stacklevel=4)

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
    them (``mode="measured"``); and per way of producing (``"workers"``,
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


def prefetch(iterable: Iterable[Any], size: int = 2, *, sharding: Any = None,
             num_threads: int = 1, timeout: float | None = None,
             closed_exception_types: Any = (StopIteration,),
             ignored_exception_types: Any = (),
             transfer: str = "by_platform",
             mode: str = "measured") -> Prefetcher:
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
      * ``"by_platform"`` (default): the path ``benchmarks/prefetch.py``
        measured faster on this backend, looked up in a table
        (``BY_PLATFORM_TRANSFER``; nothing is measured at run time). On CPU
        that is ``"device_put"`` (the stage area adds host copies there and
        moves no data to another memory). On a GPU it is ``"device_put"``
        too: on an H100 (jax 0.11.2) ``jax.device_put`` placed items of 0.25
        and 4 MiB faster over a whole run than the stage area's copy
        stream.
        ``"device_put"`` also whenever ``"stage_area"`` cannot be used (a
        ``sharding`` given, no runtime library for the backend).

      Both paths hand out the same arrays, bit for bit, with the same dtypes.
    mode: who produces the items (pulls them from the iterable and places
      them).

      * ``"measured"`` (default): worker threads only where they pay, as
        the iterator measures itself while it runs. Items are produced in
        the consumer's thread, at ``next()``, as a plain loop would, until
        the iterator's own measurements say producing one is worth hiding:
        it then moves to workers (at once when production is a third of a
        cycle and at least 200 us, going back if their first 4 items take
        1.5 times the inline cycle; else after a trial that times cycles
        with and without them), and steps aside again when
        production becomes cheap (or the consumer waits for the workers as
        long as producing the items takes). Where the device computes on
        the host's own cores (XLA:CPU), only production that waits
        (storage, a network) counts: production that needs a core
        (copying, numpy work) would compete with the step there. There,
        with asynchronous dispatch (XLA:CPU's default), cycles under 1 ms
        also get trials however cheap production is: a step dispatched a
        few microseconds after the previous result was read costs more
        than that time (``benchmarks/cpu_dispatch_gap.py``), and workers,
        which poll for room rather than be woken from ``next()``, take the
        placement out of it; in a loop that reads each result they won
        (README).
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
  args = _prefetch_checks.check(size, num_threads, timeout,
                                closed_exception_types,
                                ignored_exception_types, sharding, mode)
  placer = _transfer.resolve(transfer, sharding, args.size, FUNC)
  return Prefetcher(iterable, args.size, transfer=placer,
                    num_threads=args.num_threads, timeout=args.timeout,
                    closed_exception_types=args.closed,
                    ignored_exception_types=args.ignored, warn=True, mode=mode)
