"""The clocks staging measures itself with.

``prefetch(mode="measured")`` and ``staged(mode="measured")`` decide whether
overlap pays from their own readings of these clocks alone, so tests replace
them with fakes (``monkeypatch.setattr(_clock, "now", fake)``) and drive
every decision with made-up times. Callers read them as ``_clock.now()``
(looked up at each call), never ``from ... import now``, so the replacement
reaches them.

``now``: wall time. ``cpu`` and ``switches``: the calling thread's CPU time
and how many times it blocked (voluntary context switches), which together
tell production that needs a core (a copy, numpy work, or waiting to be
scheduled while the step holds the cores) from production that waits
(storage, a network, a sleep): ``reading`` and ``busy``.
"""

import itertools
import time

try:
  import resource
  _RUSAGE_THREAD = resource.RUSAGE_THREAD     # Linux
except (ImportError, AttributeError):
  _RUSAGE_THREAD = None

now = time.perf_counter
cpu = time.thread_time

if _RUSAGE_THREAD is not None:
  def switches() -> int:
    """Voluntary context switches of the calling thread so far."""
    return resource.getrusage(_RUSAGE_THREAD).ru_nvcsw
else:
  # Unknown: as if the thread had blocked every time (``busy`` then counts
  # only CPU time as needing a core).
  switches = itertools.count().__next__


def reading() -> tuple[float, int]:
  """The start of a ``busy`` measurement in the calling thread."""
  return cpu(), switches()


def busy(start: tuple[float, int], wall: float) -> float:
  """Of ``wall`` seconds of work in this thread since ``start``, the part
  that needed a core: its CPU time, or all of it if the thread never
  blocked (time neither running nor blocked is time it waited to be
  scheduled: it needed a core that something else, such as the step, was
  using)."""
  cpu_s, switched = cpu(), switches()
  if switched == start[1]:
    return wall
  return min(wall, max(0.0, cpu_s - start[0]))
