"""jaxstreams.prefetch: order, bounded lookahead, exceptions, timeouts,
placement, argument checks, and that no worker thread outlives its iterator;
for both transfer paths (jax.device_put and the runtime's StageArea), which
must hand out the same items bit for bit and leave no stage area behind.

Structure and values only: no assertion depends on how fast anything runs.
Waits are bounded (``_wait_until``, ``timeout=``), so a bug fails instead of
hanging.
"""

import gc
import warnings
import random
import threading
import time

import jax
import numpy as np
import pytest

import jaxstreams
import jaxstreams.runtime as rt
from jaxstreams.stage.prefetch import AUTO_TRANSFER, Prefetcher
from programs import jaxstreams_threads, wait_until

PATHS = ["device_put", "stage_area"]


def test_items_in_order_on_device():
  batches = [{"x": np.full((2, 3), i, np.float32), "y": np.int32(i)}
             for i in range(7)]
  with jaxstreams.prefetch(batches, size=3) as it:
    out = list(it)
  assert len(out) == 7
  for i, item in enumerate(out):
    assert set(item) == {"x", "y"}
    assert isinstance(item["x"], jax.Array) and isinstance(item["y"], jax.Array)
    np.testing.assert_array_equal(item["x"], batches[i]["x"])
    assert int(item["y"]) == i


def test_end_stops_workers_without_close():
  it = jaxstreams.prefetch(iter(range(3)), size=2, num_threads=2)
  assert [int(x) for x in it] == [0, 1, 2]
  assert not any(t.is_alive() for t in it.threads)  # joined at the end
  with pytest.raises(StopIteration):
    next(it)


def test_lookahead_is_bounded_by_size():
  size = 3
  pulled = []
  delivered = [0]
  ahead = []

  def source():
    for i in range(40):
      pulled.append(i)
      ahead.append(len(pulled) - delivered[0])
      yield np.full(1000, i, np.float32)

  with jaxstreams.prefetch(source(), size=size) as it:
    for i in range(40):
      if i in (0, 10):
        # Give the worker every chance to run ahead: it must stop at `size`.
        assert wait_until(lambda: len(pulled) == min(40, i + size))
        time.sleep(0.05)
        assert len(pulled) == i + size
      item = next(it)
      delivered[0] += 1
      assert int(item[0]) == i
  # The consumer counts an item just after next() returns it, by which time
  # its slot is free again: from out here the bound reads size + 1. The
  # prefetcher's own count (taken under its lock) is exact.
  assert max(ahead) <= size + 1
  assert it.max_in_flight == size


@pytest.mark.parametrize("num_threads", [2, 4])
def test_order_kept_with_many_threads(num_threads):
  rng = random.Random(0)
  delays = [rng.uniform(0, 0.01) for _ in range(30)]

  def slow_place(item):
    time.sleep(delays[item])   # later items often finish first
    return item

  it = Prefetcher(range(30), 4, transform=slow_place, num_threads=num_threads,
                  timeout=10.0, closed_exception_types=(StopIteration,),
                  ignored_exception_types=())
  with it:
    assert list(it) == list(range(30))


def test_threads_place_in_parallel():
  # Two items placed at once: both workers are inside the transform together.
  inside = []
  both = threading.Event()
  lock = threading.Lock()

  def place(item):
    with lock:
      inside.append(item)
      if len(inside) == 2:
        both.set()
    both.wait(5)
    return item

  with Prefetcher(range(2), 2, transform=place, num_threads=2, timeout=10.0,
                  closed_exception_types=(StopIteration,),
                  ignored_exception_types=()) as it:
    assert list(it) == [0, 1]
  assert both.is_set()


def test_exception_at_item_k_after_earlier_items():
  def source():
    yield np.int32(0)
    yield np.int32(1)
    raise ValueError("bad record 2")

  it = jaxstreams.prefetch(source(), size=4, timeout=10)
  assert int(next(it)) == 0
  assert int(next(it)) == 1
  with pytest.raises(ValueError, match="bad record 2"):
    next(it)
  with pytest.raises(StopIteration):
    next(it)


class _Records:
  """An iterator that survives errors: record i raises errors[i]."""

  def __init__(self, n, errors):
    self.i, self.n, self.errors = 0, n, errors

  def __iter__(self):
    return self

  def __next__(self):
    i = self.i
    self.i += 1
    if i >= self.n:
      raise StopIteration
    if i in self.errors:
      raise self.errors[i]
    return np.int32(i)


def test_ignored_exception_types_skip_items():
  source = _Records(8, {2: KeyError("x"), 5: KeyError("y")})
  with jaxstreams.prefetch(source, size=2, timeout=10,
                           ignored_exception_types=(KeyError,)) as it:
    assert [int(x) for x in it] == [0, 1, 3, 4, 6, 7]


def test_closed_exception_types_end_cleanly():
  source = _Records(8, {3: EOFError("done")})
  with jaxstreams.prefetch(source, size=2, timeout=10,
                           closed_exception_types=(EOFError,)) as it:
    assert [int(x) for x in it] == [0, 1, 2]
  assert source.i == 4   # nothing pulled past the end


def test_placement_error_is_delivered_at_its_item():
  items = [np.int32(0), np.int32(1), object(), np.int32(3)]
  it = jaxstreams.prefetch(items, size=2, timeout=10)
  assert int(next(it)) == 0 and int(next(it)) == 1
  with pytest.raises(TypeError):
    next(it)
  with pytest.raises(StopIteration):
    next(it)


def test_timeout_names_what_was_waited_for():
  release = threading.Event()

  def source():
    yield np.int32(0)
    release.wait(10)
    yield np.int32(1)

  with jaxstreams.prefetch(source(), size=2, timeout=0.05) as it:
    assert int(next(it)) == 0
    with pytest.raises(TimeoutError, match=r"item 1 of .*generator"):
      next(it)
    release.set()
    it.timeout = 10
    assert int(next(it)) == 1   # still usable after a timeout


def test_close_stops_infinite_source_and_runs_generator_finally():
  finished = threading.Event()

  def forever():
    try:
      i = 0
      while True:
        yield np.int32(i)
        i += 1
    finally:
      finished.set()

  it = jaxstreams.prefetch(forever(), size=2, num_threads=3)
  assert [int(next(it)) for _ in range(5)] == [0, 1, 2, 3, 4]
  assert len(it.threads) == 3
  it.close()
  assert not any(t.is_alive() for t in it.threads)
  assert finished.is_set()
  it.close()   # idempotent
  with pytest.raises(StopIteration):
    next(it)


def test_close_with_timeout_gives_up_on_a_blocked_source_and_cleans_up_later():
  """close(timeout) returns False while a worker is stuck in the iterable's
  __next__; when that call returns, the worker delivers nothing, exits and
  closes the generator (its finally runs), with no thread left behind."""
  entered, release, finished = threading.Event(), threading.Event(), threading.Event()

  def blocked_after_one():
    try:
      yield np.int32(0)
      entered.set()
      release.wait()
      yield np.int32(1)
      yield np.int32(2)
    finally:
      finished.set()

  it = jaxstreams.prefetch(blocked_after_one(), size=2)
  assert int(next(it)) == 0
  assert entered.wait(10)
  t0 = time.monotonic()
  assert it.close(timeout=0.05) is False
  assert time.monotonic() - t0 < 5
  assert it.threads[0].is_alive() and not finished.is_set()
  with pytest.raises(StopIteration):
    next(it)            # closed: nothing more is handed out
  release.set()
  assert wait_until(lambda: not it.threads[0].is_alive())
  assert wait_until(finished.is_set)
  assert it.close(timeout=1) is True
  with pytest.raises(StopIteration):
    next(it)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "1", True])
def test_close_timeout_must_be_a_positive_number(timeout):
  with jaxstreams.prefetch([np.zeros(2)]) as it:
    with pytest.raises((TypeError, ValueError), match="Prefetcher.close: timeout"):
      it.close(timeout=timeout)


def test_context_manager_stops_workers_on_error():
  def forever():
    while True:
      yield np.zeros(4)

  with pytest.raises(RuntimeError, match="user code"):
    with jaxstreams.prefetch(forever(), size=2, num_threads=2) as it:
      next(it)
      raise RuntimeError("user code")
  assert not any(t.is_alive() for t in it.threads)


def test_abandoned_iterator_stops_when_collected():
  def forever():
    while True:
      yield np.zeros(4)

  before = len(jaxstreams_threads("jaxstreams-prefetch"))
  it = jaxstreams.prefetch(forever(), size=2, num_threads=2)
  next(it)
  assert len(jaxstreams_threads("jaxstreams-prefetch")) == before + 2
  del it
  gc.collect()
  assert wait_until(lambda: len(jaxstreams_threads("jaxstreams-prefetch")) == before, 10.0)


def test_sharding_is_honoured():
  devices = jax.devices()
  batches = [np.arange(8, dtype=np.float32) + i for i in range(3)]
  target = devices[-1]
  with jaxstreams.prefetch(batches, sharding=target) as it:
    for item in it:
      assert item.devices() == {target}
  if len(devices) >= 2:
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    with jaxstreams.prefetch(batches, sharding=sharding) as it:
      out = list(it)
    for item, batch in zip(out, batches):
      assert item.sharding == sharding
      np.testing.assert_array_equal(item, batch)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(size=0), ValueError, "size must be >= 1, got 0"),
    (dict(size=1.5), TypeError, "size must be an integer >= 1, got 1.5"),
    (dict(size=True), TypeError, "size must be an integer >= 1, got the bool"),
    (dict(num_threads=0), ValueError, "num_threads must be >= 1, got 0"),
    (dict(timeout=-1), ValueError, "timeout must be > 0 seconds or None, got -1"),
    (dict(timeout="1s"), TypeError, "timeout must be a number of seconds"),
    (dict(closed_exception_types=(int,)), TypeError,
     "closed_exception_types must hold exception classes"),
    (dict(ignored_exception_types="KeyError"), TypeError,
     "ignored_exception_types must hold exception classes"),
    (dict(ignored_exception_types=(StopIteration,)), ValueError,
     "in both closed_exception_types and ignored_exception_types"),
    (dict(sharding="cpu"), TypeError, "sharding must be None, a jax.Device"),
])
def test_argument_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxstreams.prefetch([1, 2], **kwargs)


def test_not_iterable():
  with pytest.raises(TypeError, match="iterable must be iterable, got 3"):
    jaxstreams.prefetch(3)


def test_single_exception_class_accepted():
  source = _Records(4, {1: KeyError("x")})
  with jaxstreams.prefetch(source, ignored_exception_types=KeyError) as it:
    assert [int(x) for x in it] == [0, 2, 3]


# The stage-area path -----------------------------------------------------------


def _assert_destroyed(area):
  with pytest.raises(rt.RuntimeOpError, match=rf"stage {area.id} was destroyed"):
    area.stats()


def _bits(x):
  x = np.asarray(x)
  return x.dtype, x.shape, x.tobytes()


def _mixed_items(n):
  rng = np.random.default_rng(0)
  nan_payloads = np.array([0x7FC00001, 0xFFC00002, 0x7F800000, 0x80000000],
                          np.uint32).view(np.float32)
  for i in range(n):
    yield {"x": np.concatenate([rng.standard_normal(60).astype(np.float32),
                                nan_payloads]).reshape(8, 8),
           "f64": rng.standard_normal(5) * 10.0 ** rng.integers(-30, 30, 5),
           "ids": rng.integers(-2**31, 2**31, (3, 2), dtype=np.int64),
           "mask": rng.integers(0, 2, 7).astype(bool),
           "small": (rng.integers(-128, 128, 4).astype(np.int8),
                     np.asarray(rng.standard_normal(3), jax.numpy.bfloat16)),
           "step": np.int32(i),
           "t": np.float32(i) / 3}


@pytest.mark.parametrize("num_threads", [1, 3])
def test_both_paths_give_the_same_items_bitwise(num_threads):
  items = list(_mixed_items(12))
  outs = {}
  for path in PATHS:
    with jaxstreams.prefetch(items, size=3, num_threads=num_threads,
                             transfer=path, timeout=30) as it:
      outs[path] = list(it)
      assert it.transfer == path
      assert it.placed == ({"device_put": 12, "stage_area": 0}
                           if path == "device_put" else
                           {"device_put": 0, "stage_area": 12})
  want = [jax.device_put(item) for item in items]
  for path, out in outs.items():
    assert len(out) == len(items)
    for got, ref in zip(out, want):
      assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
      for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        assert isinstance(g, jax.Array), path
        assert _bits(g) == _bits(r), path
        assert g.weak_type == r.weak_type
        assert g.devices() == r.devices()


@pytest.mark.parametrize("num_threads", [1, 2, 4])
def test_stage_area_keeps_order_with_many_threads(num_threads):
  rng = random.Random(num_threads)

  def source():
    for i in range(60):
      if rng.random() < 0.3:
        time.sleep(rng.uniform(0, 0.003))
      yield {"i": np.full((16,), i, np.int32)}

  with jaxstreams.prefetch(source(), size=4, num_threads=num_threads,
                           transfer="stage_area", timeout=30) as it:
    got = [int(item["i"][0]) for item in it]
    area = it.stage
  assert got == list(range(60))
  assert area.capacity == 4
  _assert_destroyed(area)


def test_stage_area_lookahead_is_bounded_by_size():
  size = 3
  pulled = []

  def source():
    for i in range(30):
      pulled.append(i)
      yield np.full(1000, i, np.float32)

  allocations = []
  with jaxstreams.prefetch(source(), size=size, transfer="stage_area",
                           timeout=30) as it:
    for i in range(30):
      if i in (0, 10):
        assert wait_until(lambda: len(pulled) == min(30, i + size))
        time.sleep(0.05)
        assert len(pulled) == i + size
        stats = it.stage.stats()
        # The area holds at most size items, in memory allocated once.
        assert stats.capacity == size and stats.queued <= size
        allocations.append(stats.allocations)
      assert int(next(it)[0]) == i
    stats = it.stage.stats()
    assert stats.puts == 30 and stats.gets == 30
    assert allocations == [stats.allocations] * 2
  assert it.max_in_flight == size


def test_stage_area_errors_at_item_k_and_area_destroyed():
  def source():
    for i in range(3):
      yield np.full(4, i, np.float32)
    raise ValueError("bad record 3")

  it = jaxstreams.prefetch(source(), size=4, transfer="stage_area", timeout=10)
  assert [int(next(it)[0]) for _ in range(3)] == [0, 1, 2]
  area = it.stage
  with pytest.raises(ValueError, match="bad record 3"):
    next(it)
  _assert_destroyed(area)   # the error ended the iteration: area gone
  with pytest.raises(StopIteration):
    next(it)


def test_stage_area_ignored_and_closed_exceptions():
  source = _Records(9, {2: KeyError("x"), 5: KeyError("y"), 7: EOFError()})
  with jaxstreams.prefetch(source, size=2, timeout=10, transfer="stage_area",
                           ignored_exception_types=(KeyError,),
                           closed_exception_types=(EOFError,)) as it:
    assert [int(x) for x in it] == [0, 1, 3, 4, 6]
    assert it.placed == {"device_put": 0, "stage_area": 5}
  assert source.i == 8


def test_stage_area_items_that_do_not_fit_use_device_put_in_order():
  base = {"x": np.zeros((4, 2), np.float32), "n": np.int32(0)}
  items = [
      {"x": np.full((4, 2), 0, np.float32), "n": np.int32(0)},  # fixes the spec
      {"x": np.full((3, 2), 1, np.float32), "n": np.int32(1)},  # shape
      {"x": np.full((4, 2), 2, np.float16), "n": np.int32(2)},  # dtype
      {"x": np.full((4, 2), 3, np.float32), "n": np.int32(3)},  # fits
      {"x": np.full((4, 2), 4, np.float32)},                    # structure
      {"x": np.full((4, 2), 5, np.float32), "n": 5},            # Python int
      {"x": jax.numpy.full((4, 2), 6.0), "n": np.int32(6)},     # on device
      {"x": np.full((4, 2), 7, np.float64), "n": np.int64(7)},  # canonical: fits
      [np.float32(8)],                                         # another tree
      {"x": np.full((4, 2), 9, np.float32), "n": np.int32(9)},  # fits
  ]
  del base
  for num_threads in (1, 3):
    with jaxstreams.prefetch(items, size=3, num_threads=num_threads,
                             transfer="stage_area", timeout=30) as it:
      out = list(it)
      assert it.placed == {"stage_area": 4, "device_put": 6}
    for got, item in zip(out, items):
      ref = jax.device_put(item)
      assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
      for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        assert _bits(g) == _bits(r) and g.weak_type == r.weak_type


def test_stage_area_first_item_that_cannot_be_staged_does_not_fix_the_spec():
  items = [{"a": 1.5}, {"a": np.float32(2.5)}, {"a": np.float32(3.5)}]
  with jaxstreams.prefetch(items, transfer="stage_area", timeout=10) as it:
    assert [float(x["a"]) for x in it] == [1.5, 2.5, 3.5]
    assert it.placed == {"device_put": 1, "stage_area": 2}


def test_stage_area_placement_error_is_delivered_at_its_item():
  items = [np.int32(0), np.int32(1), object(), np.int32(3)]
  it = jaxstreams.prefetch(items, size=2, timeout=10, transfer="stage_area")
  assert int(next(it)) == 0 and int(next(it)) == 1
  with pytest.raises(TypeError):
    next(it)
  with pytest.raises(StopIteration):
    next(it)


def test_stage_area_destroyed_at_the_end_on_close_and_on_collection():
  # The end.
  it = jaxstreams.prefetch([np.ones(3, np.float32)] * 4, transfer="stage_area")
  assert len(list(it)) == 4
  _assert_destroyed(it.stage)

  def forever():
    i = 0
    while True:
      yield np.full(256, i, np.float32)
      i += 1

  # close() with workers blocked: size=1 and 3 threads, so two of them wait
  # for a slot or their turn while the area is full.
  it = jaxstreams.prefetch(forever(), size=1, num_threads=3,
                           transfer="stage_area")
  assert [int(next(it)[0]) for _ in range(5)] == [0, 1, 2, 3, 4]
  area = it.stage
  assert wait_until(lambda: area.stats().queued == 1)
  it.close()
  assert not any(t.is_alive() for t in it.threads)
  _assert_destroyed(area)

  # Abandoned: collected while the worker waits on a full pipeline.
  before = len(jaxstreams_threads("jaxstreams-prefetch"))
  it = jaxstreams.prefetch(forever(), size=2, num_threads=2,
                           transfer="stage_area")
  next(it)
  area = it.stage
  del it
  gc.collect()
  assert wait_until(lambda: len(jaxstreams_threads("jaxstreams-prefetch")) == before, 10.0)
  assert wait_until(lambda: _raises_destroyed(area), 10.0)


def _raises_destroyed(area):
  try:
    area.stats()
  except rt.RuntimeOpError:
    return True
  return False


def test_stage_area_outputs_survive_close_and_donation():
  step = jax.jit(lambda b: b * 2, donate_argnums=0)
  items = [np.full((64,), i, np.float32) for i in range(4)]
  it = jaxstreams.prefetch(items, size=2, transfer="stage_area")
  outs = [step(next(it)) for _ in range(2)]
  it.close()   # the gets already dispatched have run before the area goes
  _assert_destroyed(it.stage)
  for i, out in enumerate(outs):
    np.testing.assert_array_equal(out, items[i] * 2)


def test_stage_area_timeout_then_usable():
  release = threading.Event()

  def source():
    yield np.int32(0)
    release.wait(10)
    yield np.int32(1)

  with jaxstreams.prefetch(source(), size=2, timeout=0.05,
                           transfer="stage_area") as it:
    assert int(next(it)) == 0
    with pytest.raises(TimeoutError, match=r"item 1 of .*generator"):
      next(it)
    release.set()
    it.timeout = 10
    assert int(next(it)) == 1


def test_transfer_argument():
  with pytest.raises(ValueError, match=r"transfer must be one of \['auto', "
                                       r"'device_put', 'stage_area'\], got 'pinned'"):
    jaxstreams.prefetch([1], transfer="pinned")
  with pytest.raises(ValueError, match="transfer='stage_area' cannot be used "
                                       "here: it places items on jax's default"):
    jaxstreams.prefetch([1], sharding=jax.devices()[0], transfer="stage_area")
  # auto: the measured choice for this backend, device_put with a sharding.
  with jaxstreams.prefetch([np.ones(2)]) as it:
    assert it.transfer == AUTO_TRANSFER[jax.default_backend()]
  with jaxstreams.prefetch([np.ones(2)], sharding=jax.devices()[0]) as it:
    assert it.transfer == "device_put"
  assert AUTO_TRANSFER["gpu"] == "device_put"  # not measured


def test_describing_the_iterable_prints_no_item():
  """The iterable is described for error messages by its type and length:
  printing items (even a few large arrays) cost tens of ms per prefetch()."""
  printed = []

  class Item(np.ndarray):
    def __repr__(self):
      printed.append(1)
      return "Item"

  items = [np.zeros(4, np.float32).view(Item) for _ in range(200)]
  with jaxstreams.prefetch(items, size=2) as it:
    assert len(list(it)) == 200
    assert "list of 200 item(s)" in repr(it)
  assert not printed


# Whether prefetching pays: the decision on given counters, and the warning.

import importlib  # noqa: E402

# The module, not the function jaxstreams.stage re-exports under its name.
prefetch_module = importlib.import_module("jaxstreams.stage.prefetch")


def test_judge_waits_for_enough_items():
  pays, reason = prefetch_module.judge(99, 0, 0.0, 1.0, 0.0, 0.0)
  assert pays is None and "100" in reason and "99" in reason


def test_judge_says_no_when_items_were_ready_and_production_is_cheap():
  # 1000 items, never waited for; producing one 20 us, handing it over
  # 15 us, a step 100 us: at most 5 us of a 115 us cycle to save.
  pays, reason = prefetch_module.judge(
      items=1000, waited=3, wait_s=0.0003, handoff_s=0.015, produce_s=0.020,
      step_s=0.100)
  assert pays is False
  assert "3 of 1000" in reason and "20 us" in reason and "15 us" in reason


def test_judge_says_no_when_the_hand_off_costs_more_than_production():
  pays, _ = prefetch_module.judge(1000, 0, 0.0, 0.050, 0.010, 10.0)
  assert pays is False


def test_judge_says_yes_when_the_consumer_waits():
  pays, reason = prefetch_module.judge(1000, 400, 2.0, 0.015, 3.0, 1.0)
  assert pays is True and "400 of 1000" in reason


def test_judge_says_yes_when_production_is_a_large_share_of_a_step():
  # Never waited, but producing an item (2 ms) is hidden behind 3 ms steps.
  pays, reason = prefetch_module.judge(1000, 0, 0.0, 0.015, 2.0, 3.0)
  assert pays is True and "saves up to" in reason


def test_stats_counts_items_and_reports_a_verdict():
  batches = [np.full(3, i, np.float32) for i in range(150)]
  with jaxstreams.prefetch(batches, size=2) as it:
    assert it.stats()["items"] == 0 and it.stats()["pays"] is None
    with warnings.catch_warnings():   # the verdict depends on this machine
      warnings.simplefilter("ignore", jaxstreams.PerformanceWarning)
      got = [int(b[0]) for b in it]
    stats = it.stats()
  assert got == list(range(150))
  assert stats["items"] == 150 and 0 <= stats["waited"] <= 150
  assert stats["pays"] in (True, False) and stats["reason"]
  for key in ("wait_us", "handoff_us", "produce_us", "step_us"):
    assert stats[key] >= 0


def test_warns_once_per_prefetcher_when_it_does_not_pay(monkeypatch):
  calls = []

  def never_pays(*counts):
    calls.append(counts[0])
    return False, "judged not to pay (test)"

  monkeypatch.setattr(prefetch_module, "judge", never_pays)
  assert issubclass(jaxstreams.PerformanceWarning, UserWarning)
  batches = [np.zeros(2, np.float32)] * 350
  with pytest.warns(jaxstreams.PerformanceWarning,
                    match="judged not to pay") as record:
    with jaxstreams.prefetch(batches) as it:
      assert len(list(it)) == 350
  assert len(record) == 1
  assert calls == [100]           # judged at the 100th item, then no more


def test_only_the_public_prefetch_warns(monkeypatch):
  monkeypatch.setattr(prefetch_module, "judge",
                      lambda *counts: (False, "judged not to pay (test)"))
  batches = [np.zeros(2, np.float32)] * 150
  with Prefetcher(batches, 2, transform=lambda b: b, num_threads=1,
                  timeout=None, closed_exception_types=(StopIteration,),
                  ignored_exception_types=()) as it:
    assert len(list(it)) == 150   # filterwarnings=error: a warning fails
