"""jaxstreams.staged(mode="measured"): how it chooses between the fused
pipeline and the plain step, and that every promise holds across its switches.

The decision is the chooser prefetch uses (``_policy.Chooser``), worded for
staged: first fed made-up times, then inside runners whose clock is fake
(time moves only when a test says so: the source when it reads a batch, the
loop when it steps). Then a chooser that switches every few calls drives
runners through drains, hand-backs and warm-ups, and the outputs, their
order, each batch read once, errors at call k, donation and ``close()`` are
checked (test_staged.py and test_reliability.py run their checks with a
chooser that switches every two calls too). Structure and values only,
never timings; waits are bounded.
"""

import functools
import itertools
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from jaxstreams.staging import _clock, _measured, _policy
from programs import (FlippingChooser, assert_equal_results, meter_for,
                      jaxstreams_threads, wait_until)

WINDOW = _policy.WINDOW
US = 1e-6


def _batches(n, seed=0):
  rng = np.random.default_rng(seed)
  return [{"ids": rng.integers(0, 1000, size=(8,), dtype=np.int32),
           "x": rng.standard_normal((8, 4)).astype(np.float32)}
          for _ in range(n)]


def _params(width=3):
  rng = np.random.default_rng(1)
  return {"w": jnp.asarray(rng.standard_normal((5, width)), jnp.float32),
          "v": jnp.asarray(rng.standard_normal((width,)), jnp.float32)}


def _features(batch):
  h = (batch["ids"] * jnp.int32(0x1E3779B1)) ^ (batch["ids"] >> 3)
  return jnp.concatenate(
      [batch["x"], (h % 97).astype(jnp.float32)[:, None] / 97.0], axis=1)


def step1(params, batch):
  f = jaxstreams.stage(_features(batch))
  return jnp.sum(jnp.tanh(f @ params["w"]) @ params["v"])


def step3(params, batch):
  f = jaxstreams.stage(_features(batch))
  g = jaxstreams.stage({"a": jnp.cos(f), "b": f * f})
  h = jaxstreams.stage(g["a"] + jnp.exp(-g["b"]))
  return {"out": jnp.tanh(h @ params["w"]) @ params["v"], "i": batch["ids"][0]}


# The chooser, worded for staged: made-up times ------------------------------

def _chooser_for(unseen_gain=False):
  return _policy.Chooser(1, _policy.STAGED_WORDS, verify=True,
                         unseen_gain=unseen_gain)


def _feed(chooser, n, cycle_us, read_us, made=None):
  """Shows ``chooser`` n calls of the way it runs, through the ``Meter``
  the runner shows them through; returns the ways it switched to."""
  meter = meter_for(chooser)
  switched = []
  for _ in range(n):
    inline_made = chooser.inline if made is None else made
    if meter.count(chooser.mode, 0.0, 0.0, read_us * US, inline_made,
                   meter.last + cycle_us * US):
      switched.append(chooser.mode)
  return switched


def _trial(chooser, fused_cycle_us, plain_cycle_us, read_us):
  while chooser.trial is not None:
    cycle = fused_cycle_us if chooser.mode == "fused" else plain_cycle_us
    _feed(chooser, 1, cycle, read_us)


def test_chooser_keeps_the_plain_step_where_reading_is_cheap():
  chooser = _chooser_for()
  assert chooser.mode == "plain" and chooser.reason.startswith("judging")
  assert _feed(chooser, 2 + 10 * WINDOW, cycle_us=120, read_us=1) == []
  assert chooser.mode == "plain" and not chooser.trials
  # (Judged over windows of STEADY_S after the first: 83 calls of 120 us.)
  assert chooser.reason.startswith("reading a batch takes 1 us (1 us of "
                                   "120 us, over 83 calls), less than")
  assert "the plain step runs on batches read in the caller's thread" in (
      meter_for(chooser).news)


def _until_trial(chooser, cycle_us, read_us):
  """Feeds calls until a trial starts (at most a few gaps); returns how
  many judged calls had passed."""
  for _ in range(20_000):     # (RECHECK_S at short cycles: thousands)
    _feed(chooser, 1, cycle_us, read_us)
    if chooser.trial is not None:
      return chooser.judged + chooser.n
  raise AssertionError("no trial")


def test_chooser_stages_at_once_where_reading_dominates_then_checks():
  chooser = _chooser_for()
  assert _feed(chooser, 4, cycle_us=1500, read_us=1000) == ["fused"]
  assert chooser.reason.startswith("reading a batch is 67% of a cycle")
  assert "staged calls must come out faster" in chooser.reason
  assert meter_for(chooser).news is None
  # Staging's own cost is not known: a trial checks it, a gap later.
  due = chooser.next_trial
  assert due - chooser.judged == _policy.FIRST_TRIAL_GAP
  assert due <= _until_trial(chooser, cycle_us=600, read_us=1000) < due + 18
  assert chooser.mode == "fused"
  _trial(chooser, fused_cycle_us=600, plain_cycle_us=1500, read_us=1000)
  assert chooser.mode == "fused" and chooser.trials[-1]["chose"] == "fused"
  assert meter_for(chooser).news is None
  # Reading turns cheap: staging steps aside (its refill after the trial's
  # last switch not counted).
  assert _feed(chooser, 2 + WINDOW, cycle_us=150, read_us=2) == ["plain"]
  assert chooser.reason.startswith("reading a batch fell to 1.3% of a cycle")
  assert meter_for(chooser).news == chooser.reason


def test_chooser_tries_at_once_when_staging_did_not_shorten_the_cycle():
  chooser = _chooser_for()
  assert _feed(chooser, 4, cycle_us=1500, read_us=1000) == ["fused"]
  # Its first window (after the refill) is no faster than the plain calls
  # that chose it: a trial at once, not a gap later.
  assert _feed(chooser, 2 + WINDOW - 1, cycle_us=1500, read_us=1000) == []
  assert chooser.trial is None
  assert _feed(chooser, 1, cycle_us=1500, read_us=1000) == []
  assert chooser.trial is not None and chooser.mode == "fused"


def test_chooser_keeps_the_plain_step_when_staging_loses_its_trial():
  chooser = _chooser_for()
  _feed(chooser, 4, cycle_us=1500, read_us=1000)       # staged at once
  _until_trial(chooser, cycle_us=1700, read_us=1000)   # ... then a trial
  _trial(chooser, fused_cycle_us=1700, plain_cycle_us=1500, read_us=1000)
  assert chooser.mode == "plain" and chooser.trials[-1]["fused_won"] == 0
  assert meter_for(chooser).news.startswith(
      "the plain step runs on batches read in the caller's thread, a trial "
      "found staging no faster (median cycle 1700 us staged, 1500 us plain")


def test_chooser_checks_staging_again_while_it_runs():
  chooser = _chooser_for()
  _feed(chooser, 4, cycle_us=1500, read_us=1000)
  _until_trial(chooser, cycle_us=600, read_us=1000)
  _trial(chooser, fused_cycle_us=600, plain_cycle_us=1500, read_us=1000)
  assert chooser.mode == "fused" and chooser.trial is None
  due = chooser.next_trial          # about twice the first gap
  assert due - chooser.judged > 1.5 * _policy.FIRST_TRIAL_GAP
  assert due <= _until_trial(chooser, cycle_us=600, read_us=1000) < due + 18
  assert chooser.mode == "fused"
  _trial(chooser, fused_cycle_us=1800, plain_cycle_us=1500, read_us=1000)
  assert chooser.mode == "plain" and len(chooser.trials) == 2


def test_chooser_with_unseen_gain_tries_staging_even_where_reading_is_cheap():
  chooser = _chooser_for(unseen_gain=True)
  assert _feed(chooser, 2 + WINDOW, cycle_us=200, read_us=1) == ["fused"]
  assert chooser.reason.startswith("trial: the producer runs on a stream of "
                                   "its own")
  _trial(chooser, fused_cycle_us=150, plain_cycle_us=200, read_us=1)
  assert chooser.mode == "fused" and meter_for(chooser).news is None
  assert chooser.trials == [{"fused_cycle_us": pytest.approx(150),
                             "plain_cycle_us": pytest.approx(200),
                             "fused_won": 2, "rounds": 2, "chose": "fused",
                             "stopped_early": False}]
  assert chooser.reason.startswith("staged: a trial found it faster")
  # Cheap reading does not make it step aside (the gain is not in reading);
  # once the gap has passed, another trial decides, and it may.
  assert _feed(chooser, 10 * WINDOW, cycle_us=150, read_us=1) == []
  assert chooser.trial is None and chooser.mode == "fused"
  _until_trial(chooser, cycle_us=150, read_us=1)
  _trial(chooser, fused_cycle_us=250, plain_cycle_us=200, read_us=1)
  assert chooser.mode == "plain" and chooser.trials[-1]["chose"] == "plain"
  news = meter_for(chooser).news
  assert news and "a trial found staging no faster" in news


def test_chooser_without_unseen_gain_never_tries_cheap_reading():
  chooser = _chooser_for(unseen_gain=False)
  assert _feed(chooser, 2 + 100 * WINDOW, cycle_us=200, read_us=1) == []
  assert chooser.trials == []


# Runners with a fake clock --------------------------------------------------

class _FakeClock:
  """Stands in for ``_clock.now``: time moves only when a test says so, and
  only in the thread that moves it (a read in the reader thread takes the
  reader's time, not the loop's; the loop's step does not lengthen a read
  the reader times meanwhile)."""

  def __init__(self):
    self.local = threading.local()

  def __call__(self):
    return getattr(self.local, "now", 1000.0)

  def advance(self, us):
    self.local.now = self() + us * US


@pytest.fixture
def clock(monkeypatch):
  fake = _FakeClock()
  monkeypatch.setattr(_clock, "now", fake)
  # Reads wait (as for storage): the thread blocks at every one, so on
  # XLA:CPU they count as reading worth hiding.
  monkeypatch.setattr(_clock, "switches", itertools.count().__next__)
  return fake


def _source(clock, data, read_us, pulled=None):
  """``data``'s batches; reading batch ``i`` takes ``read_us(i)``."""
  for i, batch in enumerate(data):
    clock.advance(read_us(i))
    if pulled is not None:
      pulled.append(i)
    yield batch


def _loop(clock, runner, params, n, step_us=100):
  outs = []
  for _ in range(n):
    outs.append(runner(params))
    clock.advance(step_us)
  return outs


@pytest.mark.cpu_backend
def test_measured_keeps_the_plain_step_and_says_so_once(clock):
  params, data = _params(), _batches(100)
  with pytest.warns(jaxstreams.PerformanceWarning,
                    match=r"staged does not pay here and stepped aside: "
                          r"reading a batch takes 5 us \(5 us of 105 us") as w:
    with jaxstreams.staged(step1, data=_source(clock, data, lambda i: 5)
                           ) as runner:
      got = _loop(clock, runner, params, len(data))
      assert jaxstreams_threads("jaxstreams-prefetch") == []   # never staged
      stats = runner.stats()
      assert repr(runner).endswith("mode='measured' (plain), capacity=1, "
                                   "smart=False>")
  assert len(w) == 1
  assert_equal_results(got, [jax.jit(step1)(params, b) for b in data])
  assert stats["mode"] == "plain" and stats["switches"] == 0
  assert stats["calls"] == 100 and stats["plain"]["calls"] == 100
  assert stats["plain"]["read_us"] == pytest.approx(5)
  assert stats["fused"]["calls"] == 0
  assert runner.schedule == [] and runner.programs_run == 0
  assert runner.plan.producers      # split all the same (planning errors)


@pytest.mark.parametrize("reads", ["block", "compute"])
def test_measured_stages_where_reading_dominates_and_a_trial_confirms(
    clock, monkeypatch, reads):
  # A read that computes (numpy work, the iterable's own code: it never
  # blocks) is hidden like one that waits for storage, also on XLA:CPU,
  # where the reader thread runs it beside the step (all-CPU producer
  # staged 1.31x of the plain loop on a 2-core machine, benchmarks/README.md).
  if reads == "compute":
    monkeypatch.setattr(_clock, "switches", lambda: 0)
  params, data = _params(), _batches(420)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxstreams.PerformanceWarning)
    with jaxstreams.staged(step1, data=_source(clock, data, lambda i: 1000),
                           capacity=2) as runner:
      got = _loop(clock, runner, params, len(data))
      stats = runner.stats()
      assert repr(runner).endswith("mode='measured' (fused), capacity=2, "
                                   "smart=False>")
  assert_equal_results(got, [jax.jit(step1)(params, b) for b in data])
  # Plain, a read takes 1000 us of a 1100 us cycle; staged, the reader
  # reads in its own thread (its own time, on this clock) and a call's
  # cycle is the loop's 100 us.
  assert stats["trials"] == [{"fused_cycle_us": pytest.approx(100),
                              "plain_cycle_us": pytest.approx(1100),
                              "fused_won": 2, "rounds": 2, "chose": "fused",
                             "stopped_early": False}]
  assert stats["mode"] == "fused"
  assert stats["mode_reason"].startswith("staged: a trial found it faster")
  # Staged at once (reading is 91% of a cycle); a gap later, trial rounds
  # of both ways, staged first (two: staged won both), then staged again.
  assert stats["switches"] == 5
  # The fused programs (the latest 64) consumed batches in order, the last
  # one among them (the trial ran some plain).
  consumed = [int(name[1:]) for program in runner.schedule
              for name in program.split() if name[0] == "B"]
  assert consumed == sorted(set(consumed)) and consumed[-1] == 419
  assert jaxstreams_threads("jaxstreams-prefetch") == []


@pytest.mark.cpu_backend
def test_measured_steps_aside_when_reading_turns_cheap(clock):
  params, data, pulled = _params(), _batches(800), []
  source = _source(clock, data, lambda i: 1000 if i < 450 else 5, pulled)
  with pytest.warns(jaxstreams.PerformanceWarning,
                    match="stepped aside: reading a batch fell to") as w:
    with jaxstreams.staged(step1, data=source) as runner:
      got = _loop(clock, runner, params, len(data))
      with pytest.raises(StopIteration):
        runner(params)
      stats = runner.stats()
  assert len(w) == 1
  assert_equal_results(got, [jax.jit(step1)(params, b) for b in data])
  assert pulled == list(range(800))                  # each batch read once
  assert stats["mode"] == "plain" and stats["switches"] == 6
  assert [t["chose"] for t in stats["trials"]] == ["fused"]
  assert jaxstreams_threads("jaxstreams-prefetch") == []


@pytest.mark.parametrize("mode, read_us", [("fused", 5), ("plain", 1000)])
def test_forced_ways_never_switch_nor_warn(clock, mode, read_us):
  params, data = _params(), _batches(60)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxstreams.PerformanceWarning)
    with jaxstreams.staged(step1, data=_source(clock, data, lambda i: read_us),
                           mode=mode) as runner:
      got = _loop(clock, runner, params, len(data))
      stats = runner.stats()
  assert_equal_results(got, [jax.jit(step1)(params, b) for b in data])
  assert stats["mode"] == mode and stats["switches"] == 0
  assert stats["mode_reason"] == f"mode={mode!r} was asked for"
  assert stats[mode]["calls"] == 60
  assert (runner.programs_run > 0) == (mode == "fused")


@pytest.mark.parametrize("platform, stream, trials", [
    ("gpu", None, 1), ("gpu", 0, 0), ("cpu", None, 0)])
def test_a_trial_where_staging_may_hide_device_work(
    clock, monkeypatch, platform, stream, trials):
  """On a platform that runs streams, with the producer on a stream of its
  own, staging may hide device work no clock sees: a trial runs even though
  reading is cheap. Not with the producer on the main stream, nor on CPU."""
  monkeypatch.setattr(_measured, "_platform", lambda: platform)
  params, data = _params(), _batches(200)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxstreams.PerformanceWarning)
    with jaxstreams.staged(step1, data=_source(clock, data, lambda i: 5),
                           stream=stream) as runner:
      got = _loop(clock, runner, params, len(data))
      stats = runner.stats()
  assert_equal_results(got, [jax.jit(step1)(params, b) for b in data])
  assert len(stats["trials"]) == trials
  if trials:
    assert set(stats["trials"][0]) == {"fused_cycle_us", "plain_cycle_us",
                                       "fused_won", "rounds", "chose",
                                       "stopped_early"}
    assert stats["fused"]["calls"] > 0


def test_stats_and_repr_before_the_first_call():
  runner = jaxstreams.staged(step1, data=_batches(2))
  assert runner.stats() == {"mode": "plain", "mode_reason": "no call yet",
                            "calls": 0, "switches": 0, "trials": []}
  assert repr(runner).endswith("mode='measured', capacity=1, smart=False>")
  runner.close()


# Across switches: a chooser that switches every few calls ------------------

def _flipping(monkeypatch, every):
  monkeypatch.setattr(_policy, "Chooser",
                      functools.partial(FlippingChooser, every=every))


def _counted(data, pulled):
  for i, batch in enumerate(data):
    pulled.append(i)
    yield batch


def _check_schedule(schedule, k):
  """Each batch runs its stages in order, one per program, and the
  consumer takes the batches in order (``schedule`` keeps the latest
  programs: a batch whose first stages ran before them is seen from the
  middle)."""
  seen, consumed = {}, []
  for program in schedule:
    for name in program.split():
      part, batch = ord(name[0]) - ord("A"), int(name[1:])
      assert seen.get(batch, part - 1) == part - 1, schedule
      seen[batch] = part
      if part == k:
        consumed.append(batch)
  assert consumed == sorted(consumed), schedule


@pytest.mark.parametrize("every", [1, 2, 3, 5])
@pytest.mark.parametrize("capacity", [1, 2])
def test_switching_keeps_results_order_and_each_batch_once(
    monkeypatch, every, capacity):
  _flipping(monkeypatch, every)
  params, data, pulled = _params(), _batches(40), []
  with jaxstreams.staged(step3, data=_counted(data, pulled),
                         capacity=capacity) as runner:
    got = [runner(params) for _ in data]
    with pytest.raises(StopIteration):
      runner(params)
    stats = runner.stats()
    schedule = runner.schedule
  assert_equal_results(got, [jax.jit(step3)(params, b) for b in data])
  assert pulled == list(range(40))
  # A switch every ``every`` judged calls; after one to plain, the calls
  # on batches the pipeline held (its 3 stages and ``capacity``) are not
  # judged.
  assert stats["switches"] >= 40 // (every + 3 + capacity) - 1
  assert stats["fused"]["calls"] > 0 and stats["plain"]["calls"] > 0
  assert stats["fused"]["calls"] + stats["plain"]["calls"] == 40
  _check_schedule(schedule, 3)
  assert jaxstreams_threads("jaxstreams-prefetch") == []


def _donating(params, batch):
  f = jaxstreams.stage(batch["x"] * 2.0 + 1.0)
  g = jaxstreams.stage(jnp.sin(f))
  return jnp.sum((g + f) @ params["w"][:4]), f * 0.5


@pytest.mark.parametrize("every", [1, 2, 3])
def test_switching_never_reads_a_donated_value_nor_the_callers(monkeypatch,
                                                               every):
  _flipping(monkeypatch, every)
  params, data = _params(), _batches(30)
  placed = [jax.device_put(b) for b in data]          # the caller's arrays
  with jaxstreams.staged(_donating, data=placed) as runner:
    got = [runner(params) for _ in placed]
  assert_equal_results(got, [jax.jit(_donating)(params, b) for b in data])
  assert runner.programs_run > 0
  assert not any(x.is_deleted() for b in placed
                 for x in jax.tree_util.tree_leaves(b))


@pytest.mark.parametrize("every", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 4, 7, 11])
def test_switching_raises_a_data_error_at_its_call(monkeypatch, every, k):
  _flipping(monkeypatch, every)
  params, data, closed = _params(), _batches(20), threading.Event()

  def source():
    try:
      for i, batch in enumerate(data):
        if i == k:
          raise OSError(f"unreadable batch {i}")
        yield batch
    finally:
      closed.set()

  runner = jaxstreams.staged(step3, data=source(), capacity=2)
  got = [runner(params) for _ in range(k)]
  with pytest.raises(OSError, match=f"unreadable batch {k}"):
    runner(params)
  with pytest.raises(StopIteration):
    runner(params)
  assert_equal_results(got, [jax.jit(step3)(params, b) for b in data[:k]])
  assert wait_until(lambda: jaxstreams_threads("jaxstreams-prefetch") == [])
  assert closed.is_set()


@pytest.mark.parametrize("calls", range(1, 12))
def test_close_in_any_phase_leaves_nothing_behind(monkeypatch, calls):
  """Closed after ``calls`` calls, whatever the runner was doing then
  (warming up, staging, draining, running what the reader had read, plain):
  no thread is left, the data is closed, later calls end."""
  _flipping(monkeypatch, 2)
  params, closed = _params(), threading.Event()

  def forever():
    try:
      batch = _batches(1)[0]
      while True:
        yield batch
    finally:
      closed.set()

  runner = jaxstreams.staged(step3, data=forever(), capacity=2)
  for _ in range(calls):
    runner(params)
  runner.close()
  assert jaxstreams_threads("jaxstreams-prefetch") == []
  assert closed.is_set()
  with pytest.raises(StopIteration):
    runner(params)


def test_staging_anew_takes_the_other_arguments_as_they_are_then(monkeypatch):
  """The plain step takes other arguments of any shape; an empty pipeline
  that starts staging again is split for the ones it is called with."""
  _flipping(monkeypatch, 5)
  data = _batches(12)
  narrow, wide = _params(3), _params(5)
  runner = jaxstreams.staged(step1, data=data)
  plain_calls = [runner(narrow) for _ in range(6)]     # plain: calls 1-6
  assert runner.stats()["mode"] == "fused"             # switched after call 6
  staged_calls = [runner(wide) for _ in range(3)]      # staging anew: 7-9
  assert runner.programs_run > 0
  assert_equal_results(plain_calls + staged_calls,
        [jax.jit(step1)(narrow, b) for b in data[:6]]
        + [jax.jit(step1)(wide, b) for b in data[6:9]])
  assert runner.stats()["mode"] == "fused"
  with pytest.raises(ValueError, match="other arguments changed"):
    runner(narrow)                                     # while it stages
