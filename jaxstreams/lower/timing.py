"""How a ``jaxstreams.jit`` function's candidate ways are timed, and the
rule that decides between them: interleaved rounds of calls, as XLA's own
autotuner times kernels, and a way kept only where it beats the baseline by
``MIN_GAIN`` in the median and in most rounds. Decisions are kept on disk
(the ``jaxstreams_autotune_cache`` option), keyed by program, device kind,
candidates and versions. ``jaxstreams.lower.choose`` applies this to a
function's calls; ``jaxstreams.serve`` to its trial of grouped against
direct serving."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import statistics
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jaxlib

from jaxstreams import config

MIN_GAIN = 0.03        # a way must beat inline by this share of its time
ROUNDS = 5             # interleaved rounds of every candidate
ROUND_SECONDS = 0.005  # each candidate's share of a round, at least one call
MAX_CALLS = 50         # calls per candidate per round, at most


# ---------------------------------------------------------------------------
# The timing rule.

@dataclasses.dataclass(frozen=True)
class Trial:
  """One candidate's result: median seconds per call (None: not run),
  XLA's memory estimate of its compiled program, and why it was not run."""
  way: str
  seconds: float | None
  memory_bytes: int | None
  skipped: str = ""


@dataclasses.dataclass(frozen=True)
class Decision:
  """A signature's way, why, and when it was decided (``timing``: the
  calls it took and the compiles beside them)."""
  way: str
  reason: str
  trials: tuple[Trial, ...] = ()
  cached: bool = False
  timing: str = ""

  def describe(self) -> str:
    parts = []
    for t in self.trials:
      memory = (f", {t.memory_bytes / 2**20:.1f} MiB" if t.memory_bytes is not None
                else "")
      if t.seconds is None:
        parts.append(f"{t.way}: not run ({t.skipped}{memory})")
      else:
        parts.append(f"{t.way} {t.seconds * 1e6:.1f} us{memory}")
    timed = "; ".join(parts)
    return (self.reason + (f" [{timed}]" if timed else "")
            + (f" ({self.timing})" if self.timing else "")
            + (" (decided earlier, from the cache)" if self.cached else ""))


def memory_needed(compiled) -> int | None:
  """Device bytes a warm-up run needs: its own copies of the arguments, its
  temporaries and outputs, less what outputs alias (XLA's memory
  analysis); None where XLA does not say."""
  try:
    stats = compiled.memory_analysis()
  except Exception:   # not every backend implements it
    return None
  if stats is None:
    return None
  return int(stats.temp_size_in_bytes + stats.output_size_in_bytes
             + stats.argument_size_in_bytes - stats.alias_size_in_bytes)


def free_device_memory(device) -> int | None:
  try:
    stats = device.memory_stats()
  except Exception:   # a compile target's device, or no statistics
    return None
  if not stats or "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def too_big(memory: dict[str, int | None], free_bytes: int | None
            ) -> dict[str, str]:
  """The ways whose warm-up would not fit in ``free_bytes``, and why."""
  if free_bytes is None:
    return {}
  return {w: f"needs {m / 2**20:.1f} MiB, {free_bytes / 2**20:.1f} MiB free"
          for w, m in memory.items() if m is not None and m > free_bytes}


def time_call(way: str, run: Callable[[], Any]) -> float:
  """Seconds of one call of ``run`` (a call of candidate ``way``), its
  results waited for. The one clock of timing: tests replace it."""
  start = time.perf_counter()
  jax.block_until_ready(run())
  return time.perf_counter() - start


class Rounds:
  """Interleaved rounds of timed calls, fed one call at a time: in round
  ``r`` every way runs ``calls[way]`` calls in a row, the ways in an order
  rotated by ``r``, so drift hits them alike. ``warmup`` (a first call
  of each way) sizes a way's share of a round to ``ROUND_SECONDS``."""

  def __init__(self, warmup: dict[str, float], rounds: int = ROUNDS):
    ways = list(warmup)
    self.calls = {w: max(1, min(MAX_CALLS, math.ceil(ROUND_SECONDS / max(t, 1e-9))))
                  for w, t in warmup.items()}
    self.count = rounds
    self._schedule = [(r, w) for r in range(rounds)
                      for w in ways[r % len(ways):] + ways[:r % len(ways)]
                      for _ in range(self.calls[w])]
    self._times = {w: [[] for _ in range(rounds)] for w in ways}
    self.done = 0
    self.total = len(self._schedule)

  def next(self) -> str | None:
    """The way the next timed call runs; None once every round is done."""
    return self._schedule[self.done][1] if self.done < len(self._schedule) else None

  def record(self, way: str, seconds: float) -> None:
    r, expected = self._schedule[self.done]
    assert way == expected, (way, expected)
    self._times[way][r].append(seconds)
    self.done += 1

  def per_round(self) -> dict[str, list[float]]:
    """Each way's median call in each round."""
    return {w: [statistics.median(t) for t in times]
            for w, times in self._times.items()}


def decide(per_round: dict[str, list[float]], *, baseline: str,
           trials: Callable[[dict[str, float]], tuple[Trial, ...]]) -> Decision:
  """The rule: the fastest way in the median of its rounds, if it beats
  ``baseline`` by ``MIN_GAIN`` and in most rounds; else ``baseline``.
  ``trials(medians)`` reports every way."""
  medians = {w: statistics.median(v) for w, v in per_round.items()}
  best = min(medians, key=medians.get)
  rounds = len(per_round[baseline])
  if best == baseline:
    return Decision(baseline, f"kept {baseline!r}: no way ran faster",
                    trials(medians))
  base = medians[baseline]
  wins = sum(b < a for a, b in zip(per_round[baseline], per_round[best]))
  gain = 1 - medians[best] / base
  if gain < MIN_GAIN or wins * 2 <= rounds:
    return Decision(baseline, f"kept {baseline!r}: the fastest, {best!r}, "
                    f"gained {gain:.1%} and won {wins} of {rounds} rounds "
                    f"(needs {MIN_GAIN:.0%} and most rounds)", trials(medians))
  return Decision(best, f"chose {best!r}: {base / medians[best]:.2f}x of "
                  f"{baseline!r}, won {wins} of {rounds} rounds", trials(medians))


def time_interleaved(runs: dict[str, Callable[[], Any]], *, baseline: str,
                     timer: Callable[[str, Callable[[], Any]], float] | None = None,
                     rounds: int = ROUNDS) -> Decision:
  """Time the ways ``runs`` (way -> one call) here and now, a warm-up call
  each then interleaved ``Rounds``, and decide by the rule (``decide``).
  For callers that can run every way at once, as serve's trial does; a
  function's calls are timed one call at a time instead."""
  clock = timer or time_call
  warmup = {w: clock(w, run) for w, run in runs.items()}
  timed = Rounds(warmup, rounds)
  while (way := timed.next()) is not None:
    timed.record(way, clock(way, runs[way]))
  return decide(timed.per_round(), baseline=baseline, trials=lambda medians: tuple(
      Trial(w, medians.get(w), None) for w in runs))


# ---------------------------------------------------------------------------
# The decisions on disk.

_CACHE_LOCK = threading.Lock()


def cache_path() -> pathlib.Path | None:
  """Where decisions are kept (the ``jaxstreams_autotune_cache`` option);
  None where it is ``none``."""
  value = config.read("jaxstreams_autotune_cache")
  if value == "none":
    return None
  if value:
    return pathlib.Path(value).expanduser()
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return pathlib.Path(root) / "jaxstreams" / "autotune.json"


def cache_key(program_text: str, device_kind: str, streams: int,
              ways: Sequence[str]) -> str:
  digest = hashlib.sha256(program_text.encode()).hexdigest()[:32]
  return (f"{digest}|streams={streams}|{','.join(ways)}|{device_kind}|"
          f"jax {jax.__version__}|jaxlib {jaxlib.__version__}")


def load(key: str) -> Decision | None:
  path = cache_path()
  if path is None or not path.exists():
    return None
  try:
    entry = json.loads(path.read_text()).get(key)
    if not entry:
      return None
    trials = tuple(Trial(**t) for t in entry.get("trials", ()))
    return Decision(entry["way"], entry["reason"], trials, cached=True,
                    timing=entry.get("timing", ""))
  except (OSError, ValueError, TypeError, KeyError, AttributeError):
    return None   # an unreadable cache is an empty one


def store(key: str, decision: Decision) -> None:
  """Add ``decision`` to the cache file (written whole, then renamed, so a
  reader never sees half a file). A cache that cannot be written is
  skipped: the decision still holds for this process."""
  path = cache_path()
  if path is None:
    return
  with _CACHE_LOCK:
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      try:
        entries = json.loads(path.read_text())
      except (OSError, ValueError):
        entries = {}
      entries[key] = {"way": decision.way, "reason": decision.reason,
                      "trials": [dataclasses.asdict(t) for t in decision.trials],
                      "timing": decision.timing}
      fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".autotune-")
      with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1)
      os.replace(tmp, path)
    except OSError:
      pass
