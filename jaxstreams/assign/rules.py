"""The rules file (``jaxstreams_stream_from_file``), as in TF_STREAM_FROM_FILE.

Each line is ``N:regex1,regex2,...``: an equation whose name (its name stack
and primitive, as ``str(plan)`` shows it, e.g. ``tower_a/dot_general``)
matches any of the regexes (``re.search``) goes to stream N. The first
matching line wins. Blank lines and lines starting with ``#`` are ignored.
"""

from __future__ import annotations

import dataclasses
import os
import re


class RulesFileError(ValueError):
  """A rules file that cannot be used; the message names file, line, problem."""


@dataclasses.dataclass(frozen=True)
class StreamRules:
  path: str
  # (line, stream, regexes)
  rules: tuple[tuple[int, int, tuple[re.Pattern, ...]], ...]

  def match(self, name: str) -> tuple[int, int] | None:
    """(stream, line) of the first rule matching ``name``, or None."""
    for line, stream, patterns in self.rules:
      if any(p.search(name) for p in patterns):
        return stream, line
    return None

  def check_range(self, streams: int, streams_source: str) -> None:
    for line, stream, _ in self.rules:
      if stream >= streams:
        raise RulesFileError(
            f"{self.path}:{line}: stream {stream} is outside [0, {streams}) "
            f"(streams={streams} from {streams_source}); use a stream below "
            f"{streams} or raise streams")


_cache: dict[tuple[str, str], StreamRules] = {}


def load_rules(path: str | os.PathLike) -> StreamRules:
  """Parse a rules file. The file is read every time (it is small, and a
  rewrite that keeps the modification time, as ``cp -p`` does, must still
  count); parsing is cached by content."""
  path = os.fspath(path)
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    raise RulesFileError(f"jaxstreams_stream_from_file: cannot read {path!r}: "
                         f"{reason}") from None
  cached = _cache.get((path, text))
  if cached is None:
    if len(_cache) > 64:
      _cache.clear()
    cached = _cache[(path, text)] = StreamRules(path, tuple(_parse(path, text)))
  return cached


def _parse(path: str, text: str):
  for number, raw in enumerate(text.splitlines(), start=1):
    line = raw.strip()
    if not line or line.startswith("#"):
      continue
    head, sep, tail = line.partition(":")
    if not sep:
      raise RulesFileError(f"{path}:{number}: expected 'N:regex1,regex2', "
                           f"got {raw!r} (no ':')")
    try:
      stream = int(head.strip())
    except ValueError:
      raise RulesFileError(f"{path}:{number}: the stream id {head.strip()!r} "
                           "is not an integer") from None
    if stream < 0:
      raise RulesFileError(f"{path}:{number}: the stream id must be >= 0, "
                           f"got {stream}")
    patterns = []
    for text_pattern in (p.strip() for p in tail.split(",")):
      if not text_pattern:
        raise RulesFileError(f"{path}:{number}: empty regex in {raw!r}")
      try:
        patterns.append(re.compile(text_pattern))
      except re.error as e:
        raise RulesFileError(f"{path}:{number}: bad regex "
                             f"{text_pattern!r}: {e}") from None
    yield number, stream, tuple(patterns)
