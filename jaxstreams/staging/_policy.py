"""Does overlap pay? The one rule behind ``mode="measured"`` of ``prefetch``
and ``staged`` (``docs/sharp-edges.md``), and all its thresholds: both start
*inline*, as a plain loop runs, and move to *overlap* (hiding work behind
the step) only where their own measurements say it pays.
"""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple

from jaxstreams import _compat

WARMUP_ITEMS = 2       # first deliveries not judged (the step compiles)
WINDOW = 16            # items per judgement and per trial window
TRIAL_ROUNDS = 3       # overlap / inline window pairs in one trial
TRY_SHARE = 0.20       # production's share of a cycle worth a trial ...
TRY_US = 30.0          # ... when an item also takes this long to produce
SURE_SHARE = 1 / 3     # overlap at once, without a trial, from this share
SURE_US = 200.0        # ... and this production time per item
LEAVE_SHARE = 0.05     # overlap steps aside under this share ...
LEAVE_US = 15.0        # ... or this production time per item ...
MOSTLY_READY = 0.05    # ... if the consumer waited for at most this share
EARLY_ITEMS = 4        # an overlap window is first looked at after this many
EARLY_LOSS = 1.5       # ... and lost if its cycle is this times inline's
TRIAL_TRIM = 8         # a trial window drops its longest 1/8 of cycles
FIRST_TRIAL_GAP = 256  # judged items between trials, doubling each time
RECHECK_S = 1.0        # after overlap won, the next trial no sooner
STEADY_S = 0.01        # a settled window lasts at least this long (staged)
PREFETCH_STEADY_S = 0.1  # ... for prefetch, whose loops are the shortest
SHORT_CYCLE_US = 1000.0  # prefetch's cycles where its own time matters


class Words(NamedTuple):
  """A feature's names for its two ways and the words of its reasons."""

  overlap: str
  inline: str
  unit: str
  work: str             # what overlap hides
  hides: str
  name: str
  inline_way: str
  cost: str             # what overlap costs per item
  sure_note: str
  unseen: str           # why overlap may gain what no clock sees
  says: str
  won: str
  measured: tuple[str, str]


PREFETCH_WORDS = Words(
    overlap="workers", inline="inline", unit="items",
    work="producing an item", hides="workers hide", name="workers",
    inline_way="items are produced in the consumer's thread at next()",
    cost="a worker's hand-off and its competition for the CPU", sure_note="",
    unseen=("on CPU with asynchronous dispatch the consumer's own time "
            "between steps costs a step more than it takes, and workers "
            "take the placement out of it"),
    says="workers produce the items", won="a trial found them faster",
    measured=("with workers", "without"))

STAGED_WORDS = Words(
    overlap="fused", inline="plain", unit="calls", work="reading a batch",
    hides="staging hides", name="staging",
    inline_way="the plain step runs on batches read in the caller's thread",
    cost=("staging's own work per call (the fused program's bookkeeping, "
          "the reader's hand-off)"),
    sure_note=" (checked: staged calls must come out faster)",
    unseen=("the producer runs on a stream of its own, so staging may hide "
            "device work no clock here sees"),
    says="staged", won="a trial found it faster",
    measured=("staged", "plain"))


def for_prefetch(ahead: int, shares_cores: bool) -> Chooser:
  """``prefetch``'s chooser. On XLA:CPU with asynchronous dispatch, time
  spent between two short steps costs the next step more, so short cycles
  get trials however cheap production is."""
  return Chooser(ahead, PREFETCH_WORDS, shares_cores=shares_cores,
                 unseen_gain=shares_cores and _compat.cpu_dispatch_is_async(),
                 unseen_cycle_s=SHORT_CYCLE_US * 1e-6,
                 steady_s=PREFETCH_STEADY_S)


def for_staged(ahead: int, platform: str, stream: int) -> Chooser:
  """``staged``'s chooser: a fused program can be slower than the step, so
  trials verify it; a producer on its own GPU stream may hide device work,
  so there trials run even where reading is cheap."""
  return Chooser(ahead, STAGED_WORDS, verify=True,
                 unseen_gain=platform != "cpu" and stream != 0)


class Chooser:
  """The decision, from windows of items' *cycles* (one delivery to the
  next) and *production* times that the ``Meter`` sums; no clock, so tests
  drive it with made-up times. ``mode``: ``words.inline`` or
  ``words.overlap`` (which holds ``ahead`` items). ``shares_cores``: the
  part of placing items that needs a core does not count as production (a
  copy in a worker competes with an XLA:CPU step for memory and cores; the
  iterable's own work, waiting or computing, is hidden); ``verify``:
  trials check overlap taken at once; ``unseen_gain``: below
  ``unseen_cycle_s`` cheap production runs trials."""

  def __init__(self, ahead: int, words: Words, verify: bool = False,
               unseen_gain: bool = False, shares_cores: bool = False,
               unseen_cycle_s: float = float("inf"),
               steady_s: float = STEADY_S):
    self.ahead = ahead
    self.steady_s = steady_s
    self.words = words
    self.verify = verify
    self.unseen_gain = unseen_gain
    self.unseen_cycle_s = unseen_cycle_s
    self.shares_cores = shares_cores
    # ``busy`` costs system calls: measured only where it counts.
    self.busy_from = TRY_US * 1e-6 if shares_cores else float("inf")
    self.mode = words.inline
    self.inline = True
    self.reason = (f"judging: {words.inline_way} until {words.work} is worth "
                   f"hiding (judged every {WINDOW} {words.unit})")
    self.trial: list[tuple[str, float]] | None = None
    self.inline_cycle = 0.0    # a trial's last inline window's cycle
    self.sure_cycle = 0.0      # overlap taken at once: the cycle to beat
    self.sure_share = 0.0      # ... and the share that took it
    self.trials: list[dict[str, Any]] = []
    self.next_trial = 0        # judged items before a trial may start
    self.gap = FIRST_TRIAL_GAP
    self.tried_share = 0.0     # production's share at the last trial
    self.judged = 0            # items of the finished windows
    self.switches = 0
    self.won_trial = False     # overlap runs because it won a trial
    self.news: str | None = None   # the first step aside, for the warning
    self.news_cycle = 0.0      # ... and the inline cycle it judged
    self._told = False
    self.n = 0
    self.windows = 0
    self.steady = WINDOW       # items in a settled window (steady_s)
    self._reset()
    self.skip = WARMUP_ITEMS

  def _reset(self) -> None:
    """A new window (inline, outside a trial, judged from its 2nd item)."""
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
    """The window so far (sums over ``n`` items, in seconds; in a trial
    ``cycles`` per item); returns whether ``mode`` changed."""
    if self.shares_cores:
      produce -= busy
    else:
      busy = 0.0
    self.n, self.cycle, self.produce, self.busy = n, cycle, produce, busy
    self.waited, self.wait = waited, wait
    self.cycles = cycles or []
    if self.trial is not None:
      return self._trial_window()
    return self._judge()

  def _judge(self) -> bool:
    words = self.words
    share = self.produce / self.cycle if self.cycle > 0 else 0.0
    produce_us = self.produce / self.n * 1e6
    trial_due = self.judged + self.n >= self.next_trial
    unseen = self.unseen_gain and self.cycle < self.unseen_cycle_s * self.n
    figures = self._figures()
    if self.inline:
      if (share >= SURE_SHARE and produce_us >= SURE_US
          and share >= 2 * self.tried_share):
        self.sure_cycle, self.sure_share = self.cycle / self.n, share
        changed = self._switch(words.overlap, (
            f"{words.work} is {share:.0%} of a cycle ({figures}): "
            f"{words.hides} it behind the step{words.sure_note}"))
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
      if self.busy > self.produce:
        cheap = (f"placing each item mostly needs a core ({figures}): "
                 f"overlap would compete with the step for it rather than "
                 f"hide it")
      elif produce_us < TRY_US:
        cheap = (f"{words.work} takes {produce_us:.0f} us ({figures}), less "
                 f"than {words.cost} costs")
      else:
        cheap = (f"{words.work} is {share:.1%} of a cycle ({figures}): "
                 f"overlap could save at most that, and {words.cost} costs "
                 f"about as much")
      self.reason = f"{cheap}, so {words.inline_way}"
      if self.trials:
        self.reason += (f" (a trial found {words.name} no faster at "
                        f"{self.tried_share:.0%})")
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
      changed = self._switch(words.inline, (
          f"{words.work} fell to {share:.1%} of a cycle ({figures}) and the "
          f"consumer waited for {self.waited} of {self.n} {words.unit}: "
          f"{words.inline_way}"))
      self._step_aside_news()
      return changed
    if (self.verify or unseen) and trial_due:
      return self._start_trial(share, unseen=cheap)
    if not self.won_trial:
      self.reason = (f"{words.says}: {words.work} is {share:.0%} of a "
                     f"cycle ({figures})")
    self._reset()
    return False

  def _figures(self) -> str:
    us = 1e6 / self.n
    figures = (f"{self.produce * us:.0f} us of {self.cycle * us:.0f} us, "
               f"over {self.n} {self.words.unit}")
    if self.busy:
      figures += (f"; not counted: the {self.busy * us:.0f} us of placing "
                  f"it that needs a core, which the step needs too here")
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
      self.skip = 0 if self.inline else self.ahead + 1   # overlap fills up
    return changed

  def _start_trial(self, share: float, unseen: bool) -> bool:
    self.trial = []
    self.inline_cycle = (self.cycle / self.n if self.inline and self.n
                         else 0.0)
    self.tried_share = share
    why = (self.words.unseen + f" ({self.words.work} is {share:.0%} of a "
           f"cycle, {self._figures()})" if unseen else
           f"{self.words.work} is {share:.0%} of a cycle ({self._figures()})")
    return self._switch(self.words.overlap, f"trial: {why}; comparing "
                        f"cycles with and without {self.words.name}")

  def _trial_window(self) -> bool:
    words = self.words
    cycle = _trimmed_mean(self.cycles)
    overlap = [c for mode, c in self.trial if mode == words.overlap]
    inline = [c for mode, c in self.trial if mode == words.inline]
    if self.n < WINDOW:          # the early look at an overlap window
      if self.inline_cycle and cycle >= EARLY_LOSS * self.inline_cycle:
        return self._end_trial(overlap + [cycle],
                               inline + [self.inline_cycle], early=True)
      self.check_at = WINDOW
      return False
    self.trial.append((self.mode, cycle))
    (overlap if self.mode == words.overlap else inline).append(cycle)
    if self.inline:
      self.inline_cycle = cycle
      # A round ends with its inline window; stop once one way has won
      # most of the TRIAL_ROUNDS.
      wins = sum(o < i for o, i in zip(overlap, inline))
      decided = max(wins, len(inline) - wins) > TRIAL_ROUNDS // 2
      if decided or len(inline) == TRIAL_ROUNDS:
        return self._end_trial(overlap, inline, early=False)
    return self._switch(words.inline if self.mode == words.overlap
                        else words.overlap, self.reason)

  def _end_trial(self, overlap: list[float], inline: list[float],
                 early: bool) -> bool:
    """Records a trial (or overlap taken at once) and runs the way faster
    in most rounds; ``early``: overlap was plainly slower, so inline."""
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
    if chose == words.overlap:
      gap = max(gap, round(RECHECK_S / statistics.median(overlap)))
    self.next_trial = self.judged + gap
    self.gap *= 2
    with_, without = words.measured
    result = (f"median cycle {o_us:.0f} us {with_}, {i_us:.0f} us "
              f"{without}; {words.name} faster in {wins} of {rounds} rounds")
    if early:
      result += f"; stopped after {self.n} {words.unit}"
    if chose == words.overlap:
      changed = self._switch(words.overlap,
                             f"{words.says}: {words.won} ({result})")
      self.won_trial = True
      return changed
    changed = self._switch(words.inline, (
        f"{words.inline_way}, a trial found {words.name} no faster "
        f"({result})"))
    self._step_aside_news(statistics.median(inline))
    return changed

  def _step_aside_news(self, cycle: float | None = None) -> None:
    """The first step aside becomes ``news``, with its inline cycle."""
    if not self._told:
      self._told = True
      self.news = self.reason
      if cycle is None:
        cycle = self.cycle / self.n if self.n else 0.0
      self.news_cycle = cycle


def _trimmed_mean(cycles: list[float]) -> float:
  """The mean without the longest ``1 / TRIAL_TRIM``: one preempted item
  must not decide a trial."""
  kept = sorted(cycles)[:len(cycles) - len(cycles) // TRIAL_TRIM]
  return sum(kept) / len(kept)


class Tally:
  """What a consumer counts of one way (seconds, summed over its items)."""

  __slots__ = ("items", "waited", "wait_s", "own_s", "produce_s", "cycle_s",
               "cycles")

  def __init__(self):
    self.items = self.waited = self.cycles = 0   # cycles: all but the first
    self.wait_s = self.own_s = self.produce_s = self.cycle_s = 0.0


class Meter:
  """Per way a ``Tally``; for the ``Chooser`` (None: the way is fixed) the
  ``window`` ``[items, cycle, produce, busy, waited, wait]`` of its way's
  judged items, once ``skip`` passed. ``names``: ``report``'s keys for
  items, own time and production time."""

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
    """One item delivered ``now``: the consumer spent ``took`` on it
    (``wait`` waiting, and ``produce`` when ``inline_made``), ``busy`` of
    production needed a core. Returns whether the chooser's mode changed."""
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
    """After a judgement: the window goes on, or a new one starts in the
    chooser's way after ``skip`` items."""
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
    """``stats()``."""
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
