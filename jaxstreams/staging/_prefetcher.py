"""``jaxstreams.prefetch``: items on the device before the consumer asks
(JAX's async dispatch hides neither host work nor the copy from a loop
that does them itself). The arguments and the public iterator.
"""

from __future__ import annotations

import itertools
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterable

import jax

from jaxstreams import _checks
from jaxstreams._performance import PerformanceWarning
from jaxstreams.staging import _transfer
from jaxstreams.staging._lookahead import Pipeline
from jaxstreams.staging._policy import SHORT_CYCLE_US

FUNC = "jaxstreams.prefetch"
MODES = ("measured", "workers", "inline")
MAX_THREADS = 1024   # far more than the items worth placing at once

_names = itertools.count()


def _describe(iterable: Any) -> str:
  """For error messages: the iterable's type and length, never its items."""
  if isinstance(iterable, types.GeneratorType):
    return f"generator {iterable.__qualname__}()"
  kind = type(iterable).__qualname__
  try:
    return f"{kind} of {len(iterable)} item(s)"
  except Exception:  # noqa: BLE001 - no len(), or a len() that fails
    return f"{kind} object"


class Prefetcher:
  """The iterator ``jaxstreams.prefetch`` returns, and a context manager.
  ``transfer`` is the path in use, ``mode`` the mode asked for
  (``stats()["mode"]``: the way it runs); ``transform`` (package-internal)
  places each item with a function instead of a transfer path."""

  def __init__(self, iterable: Iterable[Any], size: int, *,
               transform: Callable[[Any], Any] | None = None,
               num_threads: int = 1, timeout: float | None = None,
               closed_exception_types: tuple = (StopIteration,),
               ignored_exception_types: tuple = (),
               transfer: Callable[[int], _transfer.Transfer] | None = None,
               warn: bool = False, mode: str = "workers"):
    if (transform is None) == (transfer is None):
      raise TypeError(f"{FUNC}: give exactly one of transform and transfer")
    if transfer is None:
      transfer = lambda size: _transfer.FunctionTransfer(transform)  # noqa: E731
    self.size = size
    self.num_threads = num_threads
    self.timeout = timeout
    self.mode = mode
    try:
      iterator = iter(iterable)
    except TypeError:
      raise TypeError(f"{FUNC}: iterable must be iterable, got {iterable!r} "
                      f"of type {type(iterable).__name__}") from None
    reason = f"mode={mode!r} was asked for"
    if mode == "measured" and timeout is not None:
      mode, reason = "workers", (
          f"workers produce the items: timeout={timeout} was given, and "
          f"only a wait for a worker can time out")
    self._closed = False
    self._warn = warn     # staged's pipelines do not warn
    # A prefetcher given as the iterable is stopped and closed with this
    # one; a generator is closed; a file the caller opened is the caller's.
    upstream = iterator._pipeline if isinstance(iterator, Prefetcher) else None
    owned = iterator if isinstance(iterator, types.GeneratorType) else None
    self._pipeline = Pipeline(
        iterator, transfer, size, num_threads, closed_exception_types,
        ignored_exception_types, _describe(iterable),
        f"jaxstreams-prefetch-{next(_names)}", mode, reason,
        upstream=upstream, owned=owned)
    self.transfer = self._pipeline.transfer.name
    # At collection, on any thread (even a worker): it only signals.
    self._finalizer = weakref.finalize(self, self._pipeline.stop, join=False)

  def __iter__(self) -> Prefetcher:
    return self

  def _get(self, wait: bool = True) -> Any:
    pipeline = self._pipeline
    try:
      item = pipeline.get(self.timeout, wait)
    except TimeoutError:
      raise             # the item may still come: stay usable
    except BaseException:
      # After close(timeout) gave up, or when the prefetcher reading this
      # one stopped it (and closes it), do not wait now.
      if not (self._closed or pipeline.owner_stopped):
        self.close()    # the end, or item k's exception: nothing follows
      raise
    if pipeline.meter.news is not None:
      self._tell()
    return item

  __next__ = _get       # one call per item, not two

  def next_if_ready(self) -> Any:
    """The next item, or ``NOT_READY`` at once (for staged's reader)."""
    return self._get(wait=False)

  def set_way(self, way: str) -> None:
    """``"workers"`` or ``"inline"`` (the workers park) from now on."""
    with self._pipeline.lock:
      if not self._pipeline.stopped:
        self._pipeline.set_mode(way)

  def holds_items(self) -> bool:
    """Whether an item was pulled and not delivered (``next()`` has it)."""
    p = self._pipeline
    with p.lock:
      return not p.stopped and p.next_out < p.next_pull

  def _tell(self) -> None:
    """The one ``PerformanceWarning``: prefetching stepped aside."""
    meter = self._pipeline.meter
    news, meter.news = meter.news, None
    if not (self._warn and news):
      return
    cycle_us = meter.news_cycle * 1e6     # what the chooser judged on
    note = ""
    if 0 < cycle_us < SHORT_CYCLE_US:
      note = (f"; with cycles this short ({cycle_us:.0f} us), even placing "
              f"each item from Python at next() costs several percent: "
              f"iterating the source directly, and letting the jitted step "
              f"take its numpy arrays, costs least")
      if getattr(meter.chooser, "unseen_gain", False):
        note += (" (on CPU with asynchronous dispatch, a step started more "
                 "than a few microseconds after the previous result was "
                 "read costs up to about 20 us more; mode='measured' tries "
                 "workers at such cycles and keeps them where a trial finds "
                 "them faster; in a loop that reads each result, "
                 "jax_cpu_enable_async_dispatch=False avoids most of that)")
    warnings.warn(
        f"jaxstreams.prefetch does not pay here and stepped aside: {news}"
        f"{note} (Prefetcher.stats() has the figures; "
        f"prefetch(mode='workers') keeps worker threads; filter "
        f"jaxstreams.PerformanceWarning to silence this)",
        PerformanceWarning, stacklevel=4)

  def close(self, timeout: float | None = None) -> bool:
    """Stops the workers and waits up to ``timeout`` seconds (None: as long
    as it takes) for them to exit; returns whether they have. A worker
    blocked inside the iterable's ``__next__`` delivers nothing and then
    closes what the iterator owns. A prefetcher given as the iterable is
    closed with it, within the same timeout. Idempotent."""
    timeout = _checks.timeout(timeout, name="timeout",
                              context="Prefetcher.close")
    self._closed = True
    self._finalizer.detach()
    return self._pipeline.stop(join=True, timeout=timeout)

  def stats(self) -> dict[str, Any]:
    """How this iterator runs and why: ``mode`` (``"workers"`` or
    ``"inline"``: the consumer's thread produces at ``next()``) and
    ``mode_reason``; ``items`` delivered; ``switches`` and ``trials``
    (``mode="measured"``); and per way ``items``, ``waited`` (how many the
    consumer waited for) and per item ``wait_us``, ``handoff_us`` (its
    other time in ``next()``), ``produce_us`` and ``cycle_us``."""
    return self._pipeline.stats()

  @property
  def max_in_flight(self) -> int:
    """Most items ever pulled and not yet delivered (at most ``size``)."""
    return self._pipeline.max_in_flight

  @property
  def threads(self) -> list[threading.Thread]:
    """The worker threads started so far."""
    return list(self._pipeline.workers.threads)

  @property
  def placed(self) -> dict[str, int]:
    """How many items each path placed: ``{"device_put": n, "stage_area":
    m}`` (``device_put`` counts the items that did not fit a stage area)."""
    return self._pipeline.transfer.counts(self._pipeline.placed)

  @property
  def stage(self) -> Any:
    """The ``jaxstreams.runtime.StageArea`` in use, else None. It is
    destroyed when the iterator stops (its ``stats()`` then raises)."""
    return getattr(self._pipeline.transfer, "area", None)

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
    size: how many items may be pulled ahead of the consumer (>= 1): item
      ``k + size`` is pulled only once item ``k`` was received.
    sharding: where items go, as for ``jax.device_put``: None (the default
      device), a ``jax.Device``, a ``jax.sharding.Sharding``, or a pytree of
      them matching the items.
    num_threads: worker threads. Pulls are one at a time; placement runs in
      parallel; items come out in the iterable's order.
    timeout: seconds the consumer waits for one item before ``TimeoutError``
      (None: no bound). The iterator stays usable after a timeout.
    closed_exception_types: exceptions that end the iteration cleanly when
      raised for an item (``StopIteration`` from the iterable always does).
    ignored_exception_types: exceptions that skip the item they were raised
      for.
    transfer: ``"device_put"``; ``"stage_area"`` (the runtime's
      ``StageArea`` of ``size`` slots, copies on its copy stream; items that
      do not fit its first item's structure, shapes and dtypes go through
      ``jax.device_put``, in order; default device only); or
      ``"by_platform"`` (default): the path measured faster on this backend
      (``BY_PLATFORM_TRANSFER``). All hand out the same arrays, bit for bit.
    mode: who produces the items. ``"measured"`` (default): the consumer's
      thread at ``next()``, as a plain loop would, until the iterator's own
      measurements say workers pay, and back when they stop paying
      (docs/sharp-edges.md); one ``jaxstreams.PerformanceWarning`` the
      first time it steps aside; with a ``timeout``, always workers.
      ``"workers"``: always worker threads. ``"inline"``: always the
      consumer's thread (no ``timeout``). ``stats()`` says which and why.

  Any other exception raised for item ``k`` is raised by ``next()`` after
  items ``< k`` were delivered, and ends the iteration. Workers stop at the
  end, on ``close()``, on leaving a ``with`` block, or when the iterator is
  garbage-collected; a stage area is destroyed then.
  """
  size = _checks.integer(size, name="size", context=FUNC, minimum=1)
  num_threads = _checks.integer(num_threads, name="num_threads", context=FUNC,
                                minimum=1)
  if num_threads > MAX_THREADS:
    raise ValueError(f"{FUNC}: num_threads must be <= {MAX_THREADS} (one "
                     f"thread each; at most size={size} items are placed at "
                     f"once), got {num_threads}")
  timeout = _checks.timeout(timeout, name="timeout", context=FUNC)
  closed = _exception_types(closed_exception_types, "closed_exception_types")
  ignored = _exception_types(ignored_exception_types, "ignored_exception_types")
  both = set(closed) & set(ignored)
  if both:
    raise ValueError(f"{FUNC}: {sorted(t.__name__ for t in both)} are in both "
                     "closed_exception_types and ignored_exception_types; an "
                     "exception either ends the iteration or skips an item")
  placement = (jax.Device, jax.sharding.Sharding)
  leaves = jax.tree_util.tree_leaves(sharding)
  bad = [leaf for leaf in leaves if not isinstance(leaf, placement)]
  if sharding is not None and (bad or not leaves):
    bad = bad[0] if bad else sharding
    raise TypeError(
        f"{FUNC}: sharding must be None, a jax.Device, a "
        f"jax.sharding.Sharding or a pytree of them matching the items, got "
        f"{bad!r} of type {type(bad).__name__}")
  _checks.one_of(mode, MODES, name="mode", context=FUNC)
  if mode == "inline" and timeout is not None:
    raise ValueError(f"{FUNC}: mode='inline' cannot honour timeout={timeout}: "
                     f"the consumer's own thread produces each item, and "
                     f"nothing can interrupt it. Use mode='workers' or "
                     f"'measured' with a timeout, or no timeout.")
  return Prefetcher(iterable, size,
                    transfer=_transfer.resolve(transfer, sharding, FUNC),
                    num_threads=num_threads, timeout=timeout,
                    closed_exception_types=closed,
                    ignored_exception_types=ignored, warn=True, mode=mode)


def _exception_types(value: Any, name: str) -> tuple[type[BaseException], ...]:
  """A tuple of exception classes from a class or a sequence of them."""
  if isinstance(value, type):
    value = (value,)
  try:
    types_ = tuple(value)
  except TypeError:
    raise TypeError(f"{FUNC}: {name} must be an exception class or a tuple of "
                    f"them, got {value!r} of type "
                    f"{type(value).__name__}") from None
  for t in types_:
    if not (isinstance(t, type) and issubclass(t, BaseException)):
      raise TypeError(f"{FUNC}: {name} must hold exception classes "
                      f"(subclasses of BaseException), got {t!r} in {value!r}")
  return types_
