"""The clocks staging measures itself with.

``prefetch(mode="auto")`` and ``staged(mode="auto")`` decide whether
overlap pays from their own readings of these clocks alone, so tests replace
them with fakes (``monkeypatch.setattr(_clock, "now", fake)``) and drive
every decision with made-up times. Callers read them as ``_clock.now()``
(looked up at each call), never ``from ... import now``, so the replacement
reaches them.

``now``: wall time. ``cpu``: the calling thread's CPU time, which tells
production that keeps a core busy (a copy, numpy work) from production
that waits (storage, a network, a sleep).
"""

import time

now = time.perf_counter
cpu = time.thread_time
