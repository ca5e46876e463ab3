"""Argument checks shared by the public functions, so every bad integer,
choice or timeout gets the same kind of message: what was given, what would
be right, and where."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any


def integer(value: Any, *, name: str, context: str, minimum: int,
            meaning: str = "", none_ok: bool = False) -> int | None:
  """``value`` as an ``int`` of at least ``minimum``.

  Python and NumPy integers are accepted; bools, floats and strings are a
  ``TypeError``, values below ``minimum`` a ``ValueError``. ``meaning`` is
  added to the range message (e.g. " (0 is the main stream)"). With
  ``none_ok``, ``None`` passes through.
  """
  if none_ok and value is None:
    return None
  wanted = ("None or " if none_ok else "") + f"an integer >= {minimum}"
  if isinstance(value, bool):
    raise TypeError(f"{context}: {name} must be {wanted}, got the bool "
                    f"{value!r}")
  try:
    number = operator.index(value)
  except TypeError:
    raise TypeError(f"{context}: {name} must be {wanted}, got {value!r} of "
                    f"type {type(value).__name__}") from None
  if number < minimum:
    raise ValueError(f"{context}: {name} must be >= {minimum}{meaning}, got "
                     f"{number}")
  return number


def one_of(value: Any, choices: tuple, *, name: str, context: str) -> Any:
  """``value`` if it is one of ``choices``; a ValueError listing them."""
  if not any(value is c or (type(value) is type(c) and value == c)
             for c in choices):
    raise ValueError(f"{context}: {name} must be one of {choices}, got "
                     f"{value!r}")
  return value


def timeout(value: Any, *, name: str, context: str, unit: str = "seconds",
            zero_ok: bool = False, none_ok: bool = True) -> float | None:
  """``value`` as a bound on a wait: a number of ``unit`` above 0 (or at
  least 0 with ``zero_ok``), or ``None`` for no bound.

  Infinity is no bound too, and comes back as ``None``: threading cannot
  wait an infinite time, so callers map ``None`` to their own "forever".
  Bools and non-numbers are a ``TypeError``; NaN, negative values (and 0
  unless ``zero_ok``) a ``ValueError``. Without ``none_ok``, ``None`` is a
  ``TypeError``.
  """
  if value is None and none_ok:
    return None
  op = ">=" if zero_ok else ">"
  or_none = " or None" if none_ok else ""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{context}: {name} must be a number of {unit} {op} 0"
                    f"{or_none}, got {value!r} of type {type(value).__name__}")
  if not (value >= 0 if zero_ok else value > 0):
    raise ValueError(f"{context}: {name} must be {op} 0 {unit}{or_none}, got "
                     f"{value!r}")
  if math.isinf(value):
    return None
  return float(value)
