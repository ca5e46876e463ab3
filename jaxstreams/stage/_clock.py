"""The one clock staging measures itself with.

``prefetch(mode="auto")`` and ``staged(mode="auto")`` decide whether
overlap pays from their own readings of this clock alone, so tests replace
``now`` with a fake clock (``monkeypatch.setattr(_clock, "now", fake)``) and
drive every decision with made-up times. Callers read it as ``_clock.now()``
(looked up at each call), never ``from ... import now``, so the replacement
reaches them.
"""

import time

now = time.perf_counter
