"""How a ``jaxstreams.jit`` function's candidate ways are timed, and the
rule that decides between them: interleaved rounds of calls, as XLA's own
autotuner times kernels, and a way kept only where it beats the baseline in
most rounds and in the median by the gain its memory asks
(``required_gain``: ``MIN_GAIN``, more for a way that needs more device
memory than the baseline). Decisions are kept on disk
(the ``jaxstreams_autotune_cache`` option), keyed by program, device kind,
candidates and versions. ``jaxstreams.choose.choice`` applies this to a
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
from jaxstreams.lower import memory as memory_

MIN_GAIN = 0.03        # a way must beat inline by this share of its time
MEMORY_PRICE = 0.2     # and by this much more per baseline's memory it adds
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
      memory = (f", {memory_.bytes_text(t.memory_bytes)}"
                if t.memory_bytes is not None else "")
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
  found = memory_.footprint(compiled)
  return None if found is None else found.needed


def required_gain(memory_ratio: float | None) -> float:
  """The share of the baseline's time a way must save to be chosen, for a
  way that needs ``memory_ratio`` times the baseline's device memory:
  ``MIN_GAIN`` (noise), plus ``MEMORY_PRICE`` for each multiple of the
  baseline's memory it adds. A way that holds half again the memory must
  save 13%; twice the memory, 23%; no more memory (or unknown), 3%."""
  extra = max(0.0, (memory_ratio or 1.0) - 1.0)
  return MIN_GAIN + MEMORY_PRICE * extra


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
    self.calls = {w: max(1, min(MAX_CALLS,
                                math.ceil(ROUND_SECONDS / max(t, 1e-9))))
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
    return (self._schedule[self.done][1] if self.done < len(self._schedule)
            else None)

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
           trials: Callable[[dict[str, float]], tuple[Trial, ...]],
           memory: dict[str, int | None] | None = None) -> Decision:
  """The rule: among the ways that beat ``baseline`` in most rounds and in
  the median by ``required_gain`` of their memory (``memory``: way ->
  bytes XLA says it needs; a way or baseline without a figure is asked
  ``MIN_GAIN``), the fastest in the median; else ``baseline``.
  ``trials(medians)`` reports every way."""
  medians = {w: statistics.median(v) for w, v in per_round.items()}
  rounds = len(per_round[baseline])
  base = medians[baseline]
  memory = memory or {}
  ratio = lambda w: (memory[w] / memory[baseline]
                     if memory.get(w) and memory.get(baseline) else None)
  verdicts = {}
  for way in sorted(medians, key=medians.get):
    if way == baseline:
      continue
    wins = sum(b < a for a, b in zip(per_round[baseline], per_round[way]))
    gain = 1 - medians[way] / base
    needs = required_gain(ratio(way))
    verdicts[way] = (gain >= needs and wins * 2 > rounds, gain, wins, needs)
  passing = [w for w, (ok, *_) in verdicts.items() if ok]
  fastest = min(medians, key=medians.get)
  if fastest == baseline:
    return Decision(baseline, f"kept {baseline!r}: no way ran faster",
                    trials(medians))
  if not passing:
    _, gain, wins, needs = verdicts[fastest]
    return Decision(baseline, f"kept {baseline!r}: the fastest, {fastest!r}, "
                    f"gained {gain:.1%} and won {wins} of {rounds} rounds "
                    f"(needs {needs:.0%}{_memory_text(ratio(fastest))} and "
                    "most rounds)", trials(medians))
  best = passing[0]
  _, gain, wins, _ = verdicts[best]
  reason = (f"chose {best!r}: {base / medians[best]:.2f}x of {baseline!r}, "
            f"won {wins} of {rounds} rounds")
  if ratio(best) is not None:
    reason += f", {ratio(best):.2f}x its memory"
  if best != fastest:
    _, gain, _, needs = verdicts[fastest]
    reason += (f"; the fastest, {fastest!r}, gained {gain:.1%} but needs "
               f"{needs:.0%}{_memory_text(ratio(fastest))}")
  return Decision(best, reason, trials(medians))


def _memory_text(ratio: float | None) -> str:
  return f" for {ratio:.2f}x the memory" if ratio and ratio > 1 else ""


def time_interleaved(runs: dict[str, Callable[[], Any]], *, baseline: str,
                     timer: (Callable[[str, Callable[[], Any]], float]
                             | None) = None,
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
  return decide(timed.per_round(), baseline=baseline,
                trials=lambda medians: tuple(
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
                      "trials": [dataclasses.asdict(t)
                                 for t in decision.trials],
                      "timing": decision.timing}
      fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".autotune-")
      with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1)
      os.replace(tmp, path)
    except OSError:
      pass
