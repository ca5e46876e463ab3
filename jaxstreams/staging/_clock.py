"""The clocks staging measures itself with (tests replace them, so callers
read ``_clock.now()`` at each call). ``reading`` and ``busy`` tell work that
needs a core from work that waits.
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
  # Unknown: as if it always blocked (``busy`` counts CPU time only).
  switches = itertools.count().__next__


def reading() -> tuple[float, int]:
  """The start of a ``busy`` measurement in the calling thread."""
  return cpu(), switches()


def busy(start: tuple[float, int], wall: float) -> float:
  """Of ``wall`` seconds of work in this thread since ``start``, the part
  that needed a core: its CPU time, or all of it if the thread never
  blocked (it then waited for a core something else was using)."""
  cpu_s, switched = cpu(), switches()
  if switched == start[1]:
    return wall
  return min(wall, max(0.0, cpu_s - start[0]))
