"""What a consumer measures of itself, per way (``Tally``), and the window
it shows the chooser (``Meter``): the judged items' sums since the window
began, so an item costs the consumer's thread a few additions.
"""

from __future__ import annotations

from typing import Any

from jaxstreams.staging._policy import Chooser


class Tally:
  """What a consumer counts of one way (seconds, summed over its items)."""

  __slots__ = ("items", "waited", "wait_s", "own_s", "produce_s", "cycle_s",
               "cycles")

  def __init__(self):
    self.items = self.waited = self.cycles = 0   # cycles: all but the first
    self.wait_s = self.own_s = self.produce_s = self.cycle_s = 0.0


class Meter:
  """Per way a ``Tally``, and the ``Chooser`` (None where the way is fixed)
  shown ``window``: ``[items, cycle, produce, busy, waited, wait]`` of the
  judged items of its way, once ``skip`` of them passed (``window`` is None
  until then). Items it must not judge (compiling, or inline ones the other
  way made) are left out. ``names`` are ``report``'s keys for the item
  count, own time and production time."""

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
    self.watched: Tally | None = None
    self.window: list | None = None
    self.skip = 0
    self.cycles: list[float] | None = None    # in a trial, each item's
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
    last, self.last = self.last, now
    if last is None:
      return False
    cycle = now - last
    tally.cycle_s += cycle
    tally.cycles += 1
    chooser = self.chooser
    if (tally is not self.watched or not judged
        or (chooser.inline and not inline_made)):
      return False
    if inline_made:
      self.time_busy = produce >= self.busy_from
    if self.window is None:
      self.skip -= 1
      if self.skip <= 0:
        self._begin()
      return False
    w = self.window
    w[0] += 1
    w[1] += cycle
    w[2] += produce
    w[3] += min(busy, produce)    # (two clocks: a hair apart)
    w[4] += wait > 0
    w[5] += wait
    if self.cycles is not None:
      self.cycles.append(cycle)
    if w[0] < chooser.check_at:
      return False
    changed = chooser.judge(*w, self.cycles)
    self._follow()
    if chooser.news is not None:
      self.news, chooser.news = chooser.news, None
      self.news_cycle = chooser.news_cycle
    return changed

  def _begin(self) -> None:
    self.window = [0, 0.0, 0.0, 0.0, 0, 0.0]
    self.cycles = [] if self.chooser.trial is not None else None

  def _follow(self) -> None:
    """After a judgement: the window goes on to its next ``check_at``, or
    a new one starts in the chooser's way after ``skip`` items."""
    chooser = self.chooser
    tally = self.tallies[chooser.mode]
    if chooser.windows == self.windows and tally is self.watched:
      return
    self.windows = chooser.windows
    self.watched = tally
    self.skip = chooser.skip
    if chooser.skip:
      self.window = self.cycles = None
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
