"""Background compiles of a first call's candidate ways: a few daemon
threads at the lowest CPU priority (XLA compiles without the GIL), so the
caller's own compile gets the CPU first."""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import os
import sys
import threading
import time
from typing import Any, Callable


# ---------------------------------------------------------------------------
# Compiling in the background.

def _lowest_priority() -> None:
  """Run the calling thread at the lowest CPU priority. Linux keeps a nice
  value per thread (and a compiler it starts inherits it); elsewhere the
  value is the process's, which is left alone."""
  if sys.platform.startswith("linux"):
    try:
      os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
      pass


def _usable_cores() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


class CompilePool:
  """Background compiles: at most ``size`` at once, in daemon threads named
  ``jaxstreams-compile`` that run at the lowest CPU priority and end once
  nothing is queued. At exit, queued compiles are cancelled and running
  ones waited for (XLA must not be torn down under a compile)."""

  def __init__(self, size: int):
    self.size = size
    self._queue: collections.deque = collections.deque()
    self._lock = threading.Lock()
    self._threads: set[threading.Thread] = set()

  def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._lock:
      self._queue.append((future, fn))
      if len(self._threads) < self.size:
        thread = threading.Thread(target=self._work, name="jaxstreams-compile",
                                  daemon=True)
        self._threads.add(thread)
        thread.start()
    return future

  def _work(self) -> None:
    _lowest_priority()
    me = threading.current_thread()
    while True:
      with self._lock:
        if not self._queue:
          self._threads.discard(me)
          return
        future, fn = self._queue.popleft()
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn())
        except Exception as error:  # noqa: BLE001 - reported with the way
          future.set_exception(error)

  def shutdown(self) -> None:
    with self._lock:
      queued, threads = list(self._queue), list(self._threads)
      self._queue.clear()
    for future, _ in queued:
      future.cancel()
    for thread in threads:
      thread.join()


POOL = CompilePool(max(1, _usable_cores() - 1))
atexit.register(lambda: POOL.shutdown())


def compile_lowered(lowered) -> tuple[Any, float]:
  """``lowered`` compiled, and the seconds it took."""
  start = time.perf_counter()
  compiled = lowered.compile()
  return compiled, time.perf_counter() - start
