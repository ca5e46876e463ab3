"""What a consumer measures of itself, per way (``Tally``), and the windows
it shows the chooser (``Meter``).

The chooser judges windows, never single items: a window's sums are the
difference of its way's tally between the window's start and its latest
item, so an item costs the consumer's thread a few additions and
comparisons. On XLA:CPU with asynchronous dispatch the consumer's time
between two short steps costs the next step more than itself.
"""

from __future__ import annotations

from typing import Any

from jaxstreams.staging._policy import Chooser


class Tally:
  """What a consumer counts of one way (seconds, summed over its items)."""

  __slots__ = ("items", "waited", "wait_s", "own_s", "produce_s", "busy_s",
               "cycle_s", "cycles")

  def __init__(self):
    self.items = 0          # items delivered to the consumer
    self.waited = 0         # of them, how many the consumer waited for
    self.wait_s = 0.0       # the consumer's time waiting for them
    self.own_s = 0.0        # its own time besides waiting and producing
    self.produce_s = 0.0    # producing them (wherever that ran)
    self.busy_s = 0.0       # ... of which a core was busy (where measured)
    self.cycle_s = 0.0      # from one delivery to the next
    self.cycles = 0         # cycles measured (not before the first item)

  def sums(self) -> tuple[int, float, float, float, int, float]:
    """What a chooser's window is the difference of: items (those with a
    cycle: all but the very first), cycle, produce, busy, waited, wait."""
    return (self.cycles, self.cycle_s, self.produce_s, self.busy_s,
            self.waited, self.wait_s)


class Meter:
  """Per way a ``Tally``, the cycle from one delivery to the next, and the
  ``Chooser`` shown the windows (None where the way is fixed). ``names``
  are ``report``'s keys for the item count, own time and production time.
  Items the chooser must not judge (compiling, or inline ones the other
  way made) are summed apart and left out of its window."""

  def __init__(self, ways: tuple[str, ...], chooser: Chooser | None,
               names: tuple[str, str, str]):
    self.tallies = {way: Tally() for way in ways}
    self.chooser = chooser
    self.names = names
    self.last: float | None = None    # when the last item was delivered
    self.news: str | None = None      # the chooser stepped aside: to tell
    self.news_cycle = 0.0             # ... and the cycle it judged (s)
    self.time_busy = False    # measure the next inline item's busy time
    self.busy_from = chooser.busy_from if chooser else float("inf")
    # The window: its way's tally, the tally's cycle count at which to act
    # (start the window while ``begin`` is None, else judge it), the sums
    # where it began, those left out, and in a trial each item's cycle.
    self.watched: Tally | None = None
    self.due = 0
    self.begin: tuple | None = None
    self.left_out = (0, 0.0, 0.0, 0.0, 0, 0.0)
    self.cycles: list[float] | None = None
    self.windows = -1                 # the chooser's window being summed
    if chooser is not None:
      self._follow()

  def count(self, way: str, took: float, wait: float, produce: float,
            inline_made: bool, now: float, judged: bool = True,
            busy: float = 0.0) -> bool:
    """One item delivered ``now``, made ``way``: the consumer spent
    ``took`` on it (``wait`` waiting; ``produce`` producing it too when
    ``inline_made``), ``busy`` of the production needed a core; judged
    unless not ``judged``. Returns whether the chooser's mode changed."""
    tally = self.tallies[way]
    tally.items += 1
    if wait > 0:
      tally.waited += 1
      tally.wait_s += wait
    tally.own_s += took - wait - (produce if inline_made else 0.0)
    tally.produce_s += produce
    if busy:
      tally.busy_s += min(busy, produce)    # (two clocks: a hair apart)
    last, self.last = self.last, now
    if last is None:
      return False
    cycle = now - last
    tally.cycle_s += cycle
    tally.cycles += 1
    if tally is not self.watched:
      return False                # no chooser, or not the way it runs
    if not judged or (self.chooser.inline and not inline_made):
      self._leave_out(cycle, wait, produce, busy)
      return False
    if inline_made:
      self.time_busy = produce >= self.busy_from
    if self.cycles is not None:
      self.cycles.append(cycle)
    if tally.cycles < self.due:
      return False
    return self._act()

  def _leave_out(self, cycle: float, wait: float, produce: float,
                 busy: float) -> None:
    """An item of the watched way the chooser must not judge."""
    self.due += 1
    if self.begin is not None:
      items, cycles, produced, busied, waited, waits = self.left_out
      self.left_out = (items + 1, cycles + cycle, produced + produce,
                       busied + min(busy, produce), waited + (wait > 0),
                       waits + wait)

  def _act(self) -> bool:
    """The window starts, or the chooser judges it."""
    if self.begin is None:        # the items to skip have passed
      self._begin()
      return False
    chooser = self.chooser
    now, begin, out = self.watched.sums(), self.begin, self.left_out
    n, cycle, produced, busy, waited, wait = (
        a - b - c for a, b, c in zip(now, begin, out))
    changed = chooser.judge(n, cycle, produced, busy, waited, wait,
                            self.cycles)
    self._follow()
    if chooser.news is not None:
      self.news, chooser.news = chooser.news, None
      self.news_cycle = chooser.news_cycle
    return changed

  def _begin(self) -> None:
    """The window starts after the watched tally's latest item."""
    tally, chooser = self.watched, self.chooser
    self.begin = tally.sums()
    self.due = tally.cycles + chooser.check_at
    self.cycles = [] if chooser.trial is not None else None

  def _follow(self) -> None:
    """After a judgement: the window goes on to its next ``check_at``, or
    a new one starts in the chooser's way after ``skip`` items."""
    chooser = self.chooser
    tally = self.tallies[chooser.mode]
    if chooser.windows == self.windows and tally is self.watched:
      self.due = self.begin[0] + self.left_out[0] + chooser.check_at
      return
    self.windows = chooser.windows
    self.watched = tally
    self.left_out = (0, 0.0, 0.0, 0.0, 0, 0.0)
    if chooser.skip:
      self.begin, self.cycles = None, None
      self.due = tally.cycles + chooser.skip
    else:
      self._begin()

  def report(self, mode: str, reason: str) -> dict[str, Any]:
    """``stats()``: the way and why, items, switches, trials, and per way
    its items and per-item times."""
    chooser = self.chooser
    items, own, produce = self.names
    report = {"mode": mode,
              "mode_reason": chooser.reason if chooser else reason,
              items: sum(t.items for t in self.tallies.values()),
              "switches": chooser.switches if chooser else 0,
              "trials": list(chooser.trials) if chooser else []}
    for way, t in self.tallies.items():
      us = 1e6 / max(t.items, 1)
      report[way] = {items: t.items, "waited": t.waited,
                     "wait_us": t.wait_s * us, own: t.own_s * us,
                     produce: t.produce_s * us,
                     "cycle_us": t.cycle_s * 1e6 / max(t.cycles, 1)}
    return report
