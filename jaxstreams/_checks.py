"""Argument checks shared by the public functions, so every bad integer gets
the same kind of message: what was given, what would be right, and where."""

from __future__ import annotations

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
