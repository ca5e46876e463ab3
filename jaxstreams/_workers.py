"""The worker threads of ``prefetch`` and ``serve``, started one way.

Both keep a few daemon threads for one owner (a prefetch pipeline, a server)
and must never leave one behind: threads are named ``<owner>-<role>`` (the
tests find leftovers by that prefix), daemon (a process may exit while one is
blocked in user code, such as an iterable's ``__next__``), and joined with
one deadline for all of them. The threads hold the owner's shared state,
never the public object, so that object can be garbage-collected while they
run; its finalizer then stops them.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Workers:
  """The threads of one owner named ``name``."""

  def __init__(self, name: str):
    self.name = name
    self.threads: list[threading.Thread] = []

  def start(self, role: str, target: Callable[[], None]) -> threading.Thread:
    """Starts ``target`` in a daemon thread named ``<name>-<role>``. Raises
    what ``Thread.start`` raises (``RuntimeError`` when the system cannot
    start another thread); the thread is then not kept."""
    thread = threading.Thread(target=target, name=f"{self.name}-{role}",
                              daemon=True)
    thread.start()
    self.threads.append(thread)
    return thread

  def join(self, timeout: float | None = None) -> bool:
    """Waits up to ``timeout`` seconds in all (None: as long as it takes) for
    every thread but the calling one (a worker may close its own owner) to
    end. Returns whether they all have."""
    deadline = None if timeout is None else time.monotonic() + timeout
    me = threading.current_thread()
    for thread in self.threads:
      if thread is not me:
        thread.join(None if deadline is None
                    else max(0.0, deadline - time.monotonic()))
    return not self.alive()

  def alive(self) -> bool:
    """Whether a thread other than the calling one still runs."""
    me = threading.current_thread()
    return any(t.is_alive() for t in self.threads if t is not me)
