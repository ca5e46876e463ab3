"""``prefetch``'s argument checks: a bad value fails at the call, with a
message naming it and what would be right, not later in a worker thread at
the first item."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from jaxstreams import _checks

FUNC = "jaxstreams.prefetch"

MODES = ("measured", "workers", "inline")

MAX_THREADS = 1024   # far more than the items worth placing at once


class Arguments(NamedTuple):
  """``prefetch``'s options, checked and normalised."""
  size: int
  num_threads: int
  timeout: float | None
  closed: tuple[type[BaseException], ...]
  ignored: tuple[type[BaseException], ...]


def check(size: Any, num_threads: Any, timeout: Any,
          closed_exception_types: Any, ignored_exception_types: Any,
          sharding: Any, mode: Any) -> Arguments:
  """Every option of ``prefetch`` but ``transfer`` (resolved with the
  transfers, ``_transfer.resolve``)."""
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
  _check_sharding(sharding)
  _checks.one_of(mode, MODES, name="mode", context=FUNC)
  if mode == "inline" and timeout is not None:
    raise ValueError(f"{FUNC}: mode='inline' cannot honour timeout={timeout}: "
                     f"the consumer's own thread produces each item, and "
                     f"nothing can interrupt it. Use mode='workers' or "
                     f"'measured' with a timeout, or no timeout.")
  return Arguments(size, num_threads, timeout, closed, ignored)


def _exception_types(value: Any, name: str) -> tuple[type[BaseException], ...]:
  """A tuple of exception classes from a class or a sequence of them."""
  if isinstance(value, type):
    value = (value,)
  try:
    types = tuple(value)
  except TypeError:
    raise TypeError(f"{FUNC}: {name} must be an exception class or a tuple of "
                    f"them, got {value!r} of type "
                    f"{type(value).__name__}") from None
  for t in types:
    if not (isinstance(t, type) and issubclass(t, BaseException)):
      raise TypeError(f"{FUNC}: {name} must hold exception classes "
                      f"(subclasses of BaseException), got {t!r} in {value!r}")
  return types


def _check_sharding(sharding: Any) -> None:
  """Accepts what ``jax.device_put`` accepts as placement: None, a Device, a
  Sharding, or a pytree (prefix) of them."""
  if sharding is None:
    return
  placement = (jax.Device, jax.sharding.Sharding)
  leaves = jax.tree_util.tree_leaves(sharding)
  bad = [leaf for leaf in leaves if not isinstance(leaf, placement)]
  if bad or not leaves:
    raise TypeError(
        f"{FUNC}: sharding must be None, a jax.Device, a "
        f"jax.sharding.Sharding or a pytree of them matching the items, got "
        f"{bad[0] if bad else sharding!r} of type "
        f"{type(bad[0] if bad else sharding).__name__}")
