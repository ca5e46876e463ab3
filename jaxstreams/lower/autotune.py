"""Timing the GPU ways of one program and keeping the fastest.

The first top-level call of a ``jaxstreams.jit`` function on a GPU compiles
each candidate way (``jaxstreams.lower.gpu.candidates``; the program
``jax.jit`` builds is always one), runs them in interleaved rounds on inputs
of their own, and keeps the fastest, as XLA's own autotuner does for
kernels. The rules:

* A candidate runs on copies of the call's arguments, made again before
  every run where arguments are donated: the caller's arrays are never
  consumed and the caller's call runs once, after the decision.
* Programs with side effects (host callbacks, ordered effects) are not
  timed: running them again would repeat the effects.
* XLA's memory analysis of each compiled candidate is reported beside its
  time; one that would not fit in the device's free memory is not run.
* ``inline`` is kept unless another way beats it by ``MIN_GAIN`` in the
  median and in most rounds: the default is never slower than ``jax.jit``
  beyond noise.
* The decision is cached on disk, keyed by the program (its StableHLO), the
  device kind and the jax and jaxlib versions, so later processes skip the
  timing; the ``jaxstreams_autotune`` option turns all of it off.
"""

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
  way: str
  reason: str
  trials: tuple[Trial, ...] = ()
  cached: bool = False

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
    return self.reason + (f" [{timed}]" if timed else "") + \
        (" (decided earlier, from the cache)" if self.cached else "")


def memory_needed(compiled) -> int | None:
  """Device bytes a candidate run needs: its own copies of the arguments,
  its temporaries and outputs, less what outputs alias (XLA's memory
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
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if not stats or "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def time_call(way: str, run: Callable[[], Any]) -> float:
  """Seconds of one call of ``run`` (a call of candidate ``way``), its
  results waited for. The one clock of autotuning: tests replace it."""
  start = time.perf_counter()
  jax.block_until_ready(run())
  return time.perf_counter() - start


def choose(runs: dict[str, Callable[[], Any]], *, memory: dict[str, int | None],
           free_bytes: int | None, baseline: str = "inline",
           failed: dict[str, str] | None = None,
           timer: Callable[[str, Callable[[], Any]], float] | None = None,
           rounds: int = ROUNDS) -> Decision:
  """Time the candidates ``runs`` (way -> a call on inputs of its own) in
  interleaved rounds and decide. ``failed`` names ways that could not be
  made, and why (reported, not run). ``timer(way, run)`` times one call
  (``time_call`` by default)."""
  clock = timer or time_call
  skipped = {w: f"needs {memory[w] / 2**20:.1f} MiB, "
                f"{free_bytes / 2**20:.1f} MiB free"
             for w in runs if free_bytes is not None
             and memory.get(w) is not None and memory[w] > free_bytes}
  skipped.update(failed or {})
  ways = [*runs, *(w for w in failed or {} if w not in runs)]
  if baseline in skipped:
    return Decision(baseline, f"kept {baseline!r}: {baseline} itself does "
                    "not fit in the device's free memory", _trials(
                        ways, {}, memory, skipped))
  timed = [w for w in runs if w not in skipped]
  # A warm-up call each (first runs load kernels), which also sizes a round.
  first = {w: clock(w, runs[w]) for w in timed}
  calls = {w: max(1, min(MAX_CALLS, math.ceil(ROUND_SECONDS / max(first[w], 1e-9))))
           for w in timed}
  per_round: dict[str, list[float]] = {w: [] for w in timed}
  for r in range(rounds):
    order = timed[r % len(timed):] + timed[:r % len(timed)]
    for w in order:
      times = [clock(w, runs[w]) for _ in range(calls[w])]
      per_round[w].append(statistics.median(times))
  medians = {w: statistics.median(v) for w, v in per_round.items()}
  best = min(medians, key=medians.get)
  trials = _trials(ways, medians, memory, skipped)
  base = medians[baseline]
  if best == baseline:
    return Decision(baseline, f"kept {baseline!r}: no way ran faster", trials)
  wins = sum(b < a for a, b in zip(per_round[baseline], per_round[best]))
  gain = 1 - medians[best] / base
  if gain < MIN_GAIN or wins * 2 <= rounds:
    return Decision(baseline, f"kept {baseline!r}: the fastest, {best!r}, "
                    f"gained {gain:.1%} and won {wins} of {rounds} rounds "
                    f"(needs {MIN_GAIN:.0%} and most rounds)", trials)
  return Decision(best, f"chose {best!r}: {base / medians[best]:.2f}x of "
                  f"{baseline!r}, won {wins} of {rounds} rounds", trials)


def _trials(ways, medians, memory, skipped) -> tuple[Trial, ...]:
  return tuple(Trial(w, medians.get(w), memory.get(w), skipped.get(w, ""))
               for w in ways)


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
  except (OSError, ValueError):
    return None   # an unreadable cache is an empty one
  if not entry:
    return None
  trials = tuple(Trial(**t) for t in entry.get("trials", ()))
  return Decision(entry["way"], entry["reason"], trials, cached=True)


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
                      "trials": [dataclasses.asdict(t) for t in decision.trials]}
      fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".autotune-")
      with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1)
      os.replace(tmp, path)
    except OSError:
      pass
