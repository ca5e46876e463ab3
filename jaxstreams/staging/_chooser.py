"""Does overlap pay? ``mode="measured"``'s decision, for ``prefetch`` and
``staged`` alike.

Both features hide work behind the consumer's step with machinery of their
own (``prefetch``: worker threads; ``staged``: a reader thread and one fused
program per call), and that machinery has a cost per item: hand-offs, its
competition for the CPU, for ``staged`` the bookkeeping of the fused
program. Where what it hides is cheap, it loses: ``prefetch`` with a worker
ran a loop of sub-millisecond steps that reads each result at 0.2x-0.85x of
the plain loop while the consumer woke it (0.96x-1.07x since it polls,
0.87x-0.95x where the loop does not read each result), ``staged`` at
0.4x-0.7x (benchmarks/prefetch_sweep.py, the shared 2-core development
machine). So each starts *inline*, as the plain loop runs (``prefetch``:
items produced in the consumer's thread; ``staged``: the plain step on
batches read in the caller's thread), and moves to its *overlap* way only
once its own measurements say the work
worth hiding (producing an item, reading a batch) is a share of the cycle
*and* more than the machinery costs: a fast consumer (a loop that does not
wait for its results) makes even a cheap item a large share of a short
cycle. One ``Chooser`` holds that policy; each feature words it
(``Words``).
"""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple

# The costs behind the thresholds, measured for prefetch: a worker costs
# 11-32 us of CPU time per item in all, 2.5-6 us of it in the consumer's
# thread (a 16x32 float32 item, the shared 2-core development machine).
WARMUP_ITEMS = 2       # deliveries not judged (the first steps compile)
WINDOW = 16            # items per judgement, and per trial window
TRIAL_ROUNDS = 3       # overlap / inline window pairs in one trial
TRY_SHARE = 0.20       # production's share of a cycle worth a trial,
TRY_US = 30.0          # ... when an item also takes this long to produce
SURE_SHARE = 1 / 3     # overlap without a trial: it would have to slow
SURE_US = 200.0        # the step by a third to lose, and an item takes
                       # several times what a worker costs
LEAVE_SHARE = 0.05     # overlap steps aside under this share,
LEAVE_US = 15.0        # ... or when an item takes less than this,
MOSTLY_READY = 0.05    # ... if the consumer waited for this share at most
                       # (or waited as long as producing takes)
SHORT_CYCLE_US = 1000.0   # cycles under which the consumer's own time
                          # between steps matters (unseen_cycle_s; the
                          # warning's note): measured on the 2-core machine,
                          # reading every step, prefetch inline ran 0.84x-
                          # 0.92x of the plain loop at 0.1 ms steps, 0.91x-
                          # 0.96x at 0.3 ms, 0.94x-0.98x at 1 ms, and from
                          # 3 ms on within 1-2% (benchmarks/prefetch_sweep.py)
FIRST_TRIAL_GAP = 256  # judged items between trials (doubling each time)
RECHECK_S = 1.0        # after a trial overlap won, the next one no sooner
                       # than this: a re-check runs its inline windows in
                       # the way that lost. At 0.1 ms cycles, 256 items
                       # apart, re-checks cost a 4000-item loop about 1.5%;
                       # 0.25 s apart, 1%-2% more than 1 s apart (three
                       # interleaved runs of 15-41 rounds, 2-core machine)
STEADY_S = 0.01        # a window outside a trial (after an inline one's
                       # first look) holds WINDOW items or as many as take
                       # this long, whichever is more: judging one costs
                       # the consumer's thread microseconds, which at
                       # 0.1 ms steps that read every result cost the loop
                       # 3.5%-5% when judged every 16th item (mode
                       # "measured" held in workers against
                       # mode="workers", two runs of 41 rounds, 2-core
                       # machine); every 10 ms, it ran
                       # within 0.5%-4% of mode="workers" (five runs).
                       # The default (staged's); prefetch, whose judging
                       # was measured apart, passes its own (steady_s)
EARLY_ITEMS = 4        # a trial's overlap window is also looked at after
EARLY_LOSS = 1.5       # this many items, and the trial ends, lost, if its
                       # cycle is this many times the last inline window's:
                       # a short loop (an epoch of 32 steps) must not spend
                       # most of itself in a way that is plainly worse
TRIAL_TRIM = 8         # a trial window's cycle: the mean without its
                       # longest 1/8 of cycles (2 of 16). One preempted
                       # item (a millisecond on a shared machine) swung
                       # windows of 0.1 ms cycles by half and lost trials
                       # that every other window of them won; a stall
                       # that recurs (every 4th item waits) still counts


class Words(NamedTuple):
  """How a feature names its two ways and words the chooser's reasons:
  ``str.format`` templates over ``share`` (production's share of a cycle),
  ``figures`` (production and cycle per item, and over how many), ``us``
  (production per item), ``tried`` (the share at the last trial),
  ``waited``, ``n``, ``window`` and, for a trial's result, ``result``
  (from the template of that name, over ``overlap_us``, ``inline_us``,
  ``wins`` and ``rounds``)."""

  overlap: str          # the way that hides work ("workers")
  inline: str           # the way the plain loop runs ("inline")
  unit: str             # what is counted ("items")
  judging: str          # before the first judgement
  sure: str             # production dominates: overlap at once
  cheap_us: str         # production costs less than the machinery ...
  cheap_share: str      # ... or is a small share of the cycle
  busy: str             # ... or mostly needs a core the step needs too
  stays: str            # inline, given ``cheap``
  lost_before: str      # appended to ``stays`` after a trial overlap lost
  leave: str            # overlap steps aside: production turned cheap
  steady: str           # overlap, production still worth hiding
  trial: str            # a trial starts: production is worth one ...
  trial_unseen: str     # ... or overlap may hide what is not measured
  result: str           # a trial's figures
  won: str              # overlap won a trial
  lost: str             # overlap lost a trial


class Chooser:
  """The decision, from what the consumer measures for each item it
  receives: its *cycle* (from one item's delivery to the next: the step,
  and the hand-off or the production) and the time spent *producing* the
  item (in the consumer's thread when inline, elsewhere otherwise), summed
  over a *window* of items by the ``Meter`` and judged once it holds
  ``check_at`` of them (``judge``). Plain bookkeeping, no clock and no
  thread, so tests drive it with made-up times. ``mode`` is
  ``words.inline`` or ``words.overlap``; ``size`` is how many items the
  overlap way holds ahead (its first ``size + 1`` items after a switch show
  it filling up, not its steady cost).

  * Windows hold ``WINDOW`` items; outside trials, after an inline
    window's first look, as many as take ``steady_s`` if that is more.
  * Inline first. After ``WINDOW`` items, production's share of a cycle is
    the most overlap could save. Under ``TRY_SHARE``, or when an item
    takes under ``TRY_US`` to produce, it stays inline (overlap's own cost
    is about that); from ``SURE_SHARE`` and ``SURE_US`` on (checked from the
    second item) it moves to overlap at once; in between it runs a *trial*.
  * ``shares_cores``: the device computes on the host's own cores (XLA:CPU).
    Production that needs a core (a copy, numpy work, or waiting to be
    scheduled while the step holds the cores: the ``busy`` time the caller
    measured, ``_clock.busy``) then competes with the step instead of
    running beside it: on the 2-core development machine a worker copying
    4 MiB items made cycles 1.2x-3.8x longer than copying them inline, and
    a trial to find that out cost a 32-step loop a fifth of its time. So
    there only the production that waits (storage, a network: wall time
    less ``busy``) counts as production, for every rule above; the busy
    part is reported apart.
  * A trial alternates overlap and inline windows of ``WINDOW`` items
    (``TRIAL_ROUNDS`` pairs; the first items after a switch to overlap,
    while it fills up, and in inline windows the items overlap had made,
    are not counted) and keeps the way whose cycle (a window's mean
    without its longest ``1 / TRIAL_TRIM``) won in most rounds; it ends
    as soon as one way has won most of them (two rounds of three).
    An overlap window whose first ``EARLY_ITEMS`` items already take
    ``EARLY_LOSS`` times the last inline window's cycle ends the trial at
    once, lost. Trials are spaced ``FIRST_TRIAL_GAP`` judged items apart,
    doubling (after one overlap won, also ``RECHECK_S`` seconds at least),
    and another one only starts once production's share has at least
    doubled since the last: a trial costs items in the worse way.
  * Overlap taken at once is looked at the same way: if its first
    ``EARLY_ITEMS`` items take ``EARLY_LOSS`` times the cycle of the inline
    items that chose it, it goes back inline, recorded as a trial it lost
    (moving to overlap at once is a guess from production's share; on a
    machine where the overlap way competes with the step for the same
    cores it can be plainly worse), and only a share at least twice as
    large moves it at once again.
  * In overlap it steps aside when production falls under ``LEAVE_SHARE``
    of a cycle or ``LEAVE_US`` per item and the consumer almost never
    waits, or waits as long as producing the items takes (overlap is then
    slower than producing them inline could be: its hand-off is late).
  * ``verify``: overlap's own cost is not bounded by a known hand-off
    (``staged``: its fused program can run slower than the step itself).
    Overlap taken at once must beat, in its first window, the cycle of the
    inline items that chose it, or a trial runs at once; after that, while
    it runs, trials check it whenever the gap allows (the first
    ``FIRST_TRIAL_GAP`` judged items later).
  * ``unseen_gain``: overlap may also gain what these measurements cannot
    see (``staged`` on a platform that runs streams: the producer's device
    work beside the consumer's; ``prefetch`` on XLA:CPU with asynchronous
    dispatch: the consumer's own time between two steps, which costs a
    step more than it takes, benchmarks/cpu_dispatch_gap.py). A cheap
    production then decides nothing: inline runs a trial whenever the gap
    allows, and overlap, instead of stepping aside, runs one. Only while
    the window's mean cycle is under ``unseen_cycle_s``: a gain of a few
    microseconds a step is past what a trial can tell on longer cycles.
  """

  def __init__(self, size: int, words: Words, verify: bool = False,
               unseen_gain: bool = False, shares_cores: bool = False,
               unseen_cycle_s: float = float("inf"),
               steady_s: float = STEADY_S):
    self.size = size
    self.steady_s = steady_s
    self.words = words
    self.verify = verify
    self.unseen_gain = unseen_gain
    self.unseen_cycle_s = unseen_cycle_s
    self.shares_cores = shares_cores
    # From which production time an inline item's ``busy`` is worth
    # measuring (it costs four system calls): where it changes anything,
    # and for items not too cheap to decide anything.
    self.busy_from = TRY_US * 1e-6 if shares_cores else float("inf")
    self.mode = words.inline
    self.inline = True
    self.reason = words.judging.format(window=WINDOW)
    self.trial: list[tuple[str, float]] | None = None
    self.inline_cycle = 0.0    # in a trial: the last inline window's cycle
    self.sure_cycle = 0.0      # overlap taken at once: the inline cycle it
                               # must beat, until its first window is judged
    self.sure_share = 0.0      # ... and production's share that took it
    self.trials: list[dict[str, Any]] = []
    self.next_trial = 0        # judged items before a trial may start
    self.gap = FIRST_TRIAL_GAP
    self.tried_share = 0.0     # production's share at the last trial
    self.judged = 0            # items of the finished windows
    self.switches = 0
    self.won_trial = False     # overlap runs because it won a trial
    self.news: str | None = None   # the first step aside, for the warning
    self.news_cycle = 0.0      # ... and the inline cycle it saw (seconds)
    self._told = False
    self.n = 0
    self.windows = 0
    self.steady = WINDOW       # items in a steady window (steady_s)
    self._reset()
    self.skip = WARMUP_ITEMS

  def _reset(self) -> None:
    """A new window (``windows`` counts them, for the ``Meter``). Inline
    (not in a trial) it is first judged at its second item, so a producer
    that clearly needs hiding gets overlap soon; otherwise once full."""
    self.judged += self.n
    self.windows += 1
    if self.n and self.cycle > 0:
      self.steady = max(WINDOW, round(self.steady_s * self.n / self.cycle))
    self.n = 0
    self.skip = 0              # items that pass before the window starts
    if self.trial is None:
      self.check_at = (2 if self.inline
                       else EARLY_ITEMS if self.sure_cycle else self.steady)
    else:
      self.check_at = WINDOW if self.inline else EARLY_ITEMS

  def judge(self, n: int, cycle: float, produce: float, busy: float,
            waited: int, wait: float, cycles: list[float] | None) -> bool:
    """The window so far, once it holds ``check_at`` items (the ``Meter``
    sums them: the chooser sees no single item, so that the consumer's
    thread pays next to nothing per item for it): ``n`` items, their
    cycles and production summed, of that production the time that needed
    a core (``busy``; 0 where not measured), how many the consumer waited
    for and how long, in seconds; in a trial also each item's cycle.
    Returns whether ``mode`` changed; after it, ``windows`` says whether
    a new window starts (after ``skip`` items) and ``check_at`` when the
    window is judged next."""
    if self.shares_cores:
      produce -= busy     # not worth hiding here: counted apart
    else:
      busy = 0.0
    self.n, self.cycle, self.produce, self.busy = n, cycle, produce, busy
    self.waited, self.wait = waited, wait
    self.cycles = cycles or []
    return self._judge()

  def _judge(self) -> bool:
    if self.trial is not None:
      return self._trial_window()
    words = self.words
    share = self.produce / self.cycle if self.cycle > 0 else 0.0
    produce_us = self.produce / self.n * 1e6
    trial_due = self.judged + self.n >= self.next_trial
    unseen = self.unseen_gain and self.cycle < self.unseen_cycle_s * self.n
    if self.inline:
      if (share >= SURE_SHARE and produce_us >= SURE_US
          and share >= 2 * self.tried_share):
        self.sure_cycle, self.sure_share = self.cycle / self.n, share
        changed = self._switch(words.overlap, words.sure.format(
            share=share, figures=self._figures()))
        if self.verify:     # checked against this window, then a gap later
          self.next_trial = self.judged + self.gap
          self.gap *= 2
        return changed
      if self.n < WINDOW:
        self.check_at = self.steady
        return False
      worth = (share >= max(TRY_SHARE, 2 * self.tried_share)
               and produce_us >= TRY_US)
      if (worth or unseen) and trial_due:
        return self._start_trial(share, unseen=not worth)
      if self.busy > self.produce:    # mostly needs a core the step needs
        cheap = words.busy.format(figures=self._figures())
      else:
        cheap = (words.cheap_us if produce_us < TRY_US else words.cheap_share
                 ).format(us=produce_us, share=share, figures=self._figures())
      self.reason = words.stays.format(cheap=cheap)
      if self.trials:
        self.reason += words.lost_before.format(tried=self.tried_share)
      self._step_aside_news()
      self._reset()
      return False
    if self.sure_cycle:          # overlap taken at once: its first window
      cycle, sure = self.cycle / self.n, self.sure_cycle
      if self.n < WINDOW:        # the early look
        if cycle >= EARLY_LOSS * sure:
          self.tried_share, self.sure_cycle = self.sure_share, 0.0
          return self._end_trial([cycle], [sure], early=True)
        self.check_at = WINDOW
        return False
      self.sure_cycle = 0.0
      if self.verify and cycle >= sure:   # it did not shorten the cycle
        return self._start_trial(share, unseen=False)
    cheap = ((share < LEAVE_SHARE or produce_us < LEAVE_US)
             and (self.waited <= MOSTLY_READY * self.n
                  or self.wait >= self.produce))
    if cheap and not unseen:
      self.tried_share = 0.0
      changed = self._switch(words.inline, words.leave.format(
          share=share, figures=self._figures(), waited=self.waited,
          n=self.n))
      self._step_aside_news()
      return changed
    if (self.verify or unseen) and trial_due:
      return self._start_trial(share, unseen=cheap)
    if not self.won_trial:
      self.reason = words.steady.format(share=share, figures=self._figures())
    self._reset()
    return False

  def _figures(self) -> str:
    us = 1e6 / self.n
    figures = (f"{self.produce * us:.0f} us of {self.cycle * us:.0f} us, "
               f"over {self.n} {self.words.unit}")
    if self.busy:
      figures += (f"; counted: the time it waits, not the "
                  f"{self.busy * us:.0f} us it needs a core, which the step "
                  f"needs too here")
    return figures

  def _switch(self, mode: str, reason: str) -> bool:
    self.reason = reason
    self.won_trial = False
    changed = mode != self.mode
    self.mode = mode
    self.inline = mode == self.words.inline
    self._reset()
    if changed:
      self.switches += 1
      # Overlap starts empty: its first items after the switch show it
      # filling up, not its steady cost.
      self.skip = 0 if self.inline else self.size + 1
    return changed

  def _start_trial(self, share: float, unseen: bool) -> bool:
    self.trial = []
    self.inline_cycle = (self.cycle / self.n if self.inline and self.n
                         else 0.0)
    self.tried_share = share
    template = self.words.trial_unseen if unseen else self.words.trial
    return self._switch(self.words.overlap, template.format(
        share=share, figures=self._figures()))

  def _trial_window(self) -> bool:
    words = self.words
    cycle = _trimmed_mean(self.cycles)
    overlap = [c for mode, c in self.trial if mode == words.overlap]
    inline = [c for mode, c in self.trial if mode == words.inline]
    if self.n < WINDOW:          # the early look at an overlap window
      if self.inline_cycle and cycle >= EARLY_LOSS * self.inline_cycle:
        # Paired with the inline window it was measured against.
        return self._end_trial(overlap + [cycle],
                               inline + [self.inline_cycle], early=True)
      self.check_at = WINDOW
      return False
    self.trial.append((self.mode, cycle))
    (overlap if self.mode == words.overlap else inline).append(cycle)
    if self.inline:
      self.inline_cycle = cycle
      # A round ends with its inline window; once one way has won most of
      # the TRIAL_ROUNDS, the rounds left cannot change the result.
      wins = sum(o < i for o, i in zip(overlap, inline))
      decided = max(wins, len(inline) - wins) > TRIAL_ROUNDS // 2
      if decided or len(inline) == TRIAL_ROUNDS:
        return self._end_trial(overlap, inline, early=False)
    return self._switch(words.inline if self.mode == words.overlap
                        else words.overlap, self.reason)

  def _end_trial(self, overlap: list[float], inline: list[float],
                 early: bool) -> bool:
    """Ends a trial, or overlap taken at once, on the ``overlap`` and
    ``inline`` window cycles compared pairwise: records it and runs the way
    that won most rounds; ``early``: an overlap window plainly slower after
    its first ``self.n`` items, so inline, lost."""
    words = self.words
    wins = sum(o < i for o, i in zip(overlap, inline))
    rounds = len(overlap)
    chose = (words.overlap if not early and wins > TRIAL_ROUNDS // 2
             else words.inline)
    o_us = statistics.median(overlap) * 1e6
    i_us = statistics.median(inline) * 1e6
    self.trials.append({f"{words.overlap}_cycle_us": o_us,
                        f"{words.inline}_cycle_us": i_us,
                        f"{words.overlap}_won": wins, "rounds": rounds,
                        "chose": chose, "stopped_early": early})
    self.trial = None
    gap = self.gap
    won_cycle = statistics.median(overlap)
    if chose == words.overlap and won_cycle > 0:
      gap = max(gap, round(RECHECK_S / won_cycle))
    self.next_trial = self.judged + gap
    self.gap *= 2
    result = words.result.format(overlap_us=o_us, inline_us=i_us, wins=wins,
                                 rounds=rounds)
    if early:
      result += f"; stopped after {self.n} {words.unit}"
    if chose == words.overlap:
      changed = self._switch(words.overlap, words.won.format(result=result))
      self.won_trial = True
      return changed
    changed = self._switch(words.inline, words.lost.format(result=result))
    self._step_aside_news(statistics.median(inline))
    return changed

  def _step_aside_news(self, cycle: float | None = None) -> None:
    """The first step aside becomes ``news``, with the inline cycle it was
    judged on (``cycle``, else this window's mean: never the first items',
    which may include compiling the step)."""
    if not self._told:
      self._told = True
      self.news = self.reason
      if cycle is None:
        cycle = self.cycle / self.n if self.n else 0.0
      self.news_cycle = cycle


def _trimmed_mean(cycles: list[float]) -> float:
  """The mean of ``cycles`` without the longest ``1 / TRIAL_TRIM`` of
  them."""
  kept = sorted(cycles)[:len(cycles) - len(cycles) // TRIAL_TRIM]
  return sum(kept) / len(kept)


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
  """What a consumer measures of itself: per way, a ``Tally``; from one
  delivery to the next, the cycle; and the ``Chooser`` they are shown
  (None where the way is fixed). ``names`` are the keys ``report`` gives the
  count of items, the own time and the production time per item.

  The chooser judges *windows*, never single items: a window's sums are
  the difference of its way's tally between the window's start and its
  last item, so an item costs the consumer's thread a few comparisons
  more than a fixed way does. (On XLA:CPU with asynchronous dispatch, the
  consumer's time between two short steps costs the next step several
  times over: showing the chooser each item cost a loop of 0.1 ms steps
  that reads every result 1.6%-6% against ``mode="workers"`` in four
  interleaved runs of 31-61 rounds on the 2-core machine, jax 0.10.2; the
  windows' own judging, ``STEADY_S``.) Items the chooser must not judge
  (not ``judged``; in its inline way, ones it did not make) are summed
  apart and left out."""

  def __init__(self, ways: tuple[str, ...], chooser: Chooser | None,
               names: tuple[str, str, str]):
    self.tallies = {way: Tally() for way in ways}
    self.chooser = chooser
    self.names = names
    self.last: float | None = None    # when the last item was delivered
    self.news: str | None = None      # the chooser stepped aside: to tell
    self.news_cycle = 0.0             # ... and the cycle it judged (s)
    # Whether the caller measures the next inline item's ``busy``
    # (``_clock.reading`` / ``_clock.busy``): the last one took long
    # enough for the chooser to want it.
    self.time_busy = False
    self.busy_from = chooser.busy_from if chooser else float("inf")
    # The chooser's window: the tally of its way (``watched``), the count
    # of that tally's cycles at which to act next (``due``: the window starts
    # there while ``begin`` is None, else it is judged), the tally's sums
    # where the window began, the sums of its items left out, and in a
    # trial each item's cycle.
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
    """One item delivered ``now`` the ``way`` it was made: the consumer
    spent ``took`` on it, ``wait`` of that waiting, and producing it took
    ``produce`` (in ``took`` when ``inline_made``; ``busy`` of it needed a
    core, where measured); shown to the chooser when ``judged``. Returns
    whether the chooser's mode changed. (Runs for every item: lean.)"""
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
    """An item of the watched way the chooser does not judge: one compiling
    the step, or (inline) one made by the other way before the switch."""
    self.due += 1
    if self.begin is not None:
      items, cycles, produced, busied, waited, waits = self.left_out
      self.left_out = (items + 1, cycles + cycle, produced + produce,
                       busied + min(busy, produce), waited + (wait > 0),
                       waits + wait)

  def _act(self) -> bool:
    """The watched tally reached ``due``: the window starts, or the chooser
    judges it."""
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
    """The window starts here, after the watched tally's latest item; in a
    trial it also collects each item's cycle."""
    tally, chooser = self.watched, self.chooser
    self.begin = tally.sums()
    self.due = tally.cycles + chooser.check_at
    self.cycles = [] if chooser.trial is not None else None

  def _follow(self) -> None:
    """After the chooser judged: the same window goes on to its next
    ``check_at``, or a new one starts, in its way, after ``skip`` items."""
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
    """``stats()``: the way it runs now and why (the chooser's reason, or
    ``reason`` where there is none), the items, switches and trials, and
    per way its items and per-item times."""
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
