"""jaxstreams.prefetch: order, bounded lookahead, exceptions, timeouts,
placement, argument checks, and that no worker thread outlives its iterator;
for both transfer paths (jax.device_put and the runtime's StageArea), which
must hand out the same items bit for bit and leave no stage area behind;
for both ways of producing items (worker threads, the consumer's own thread)
and across switches between them; and how ``mode="measured"`` chooses, from
made-up measurements and a fake clock.

Structure and values only: no assertion depends on how fast anything runs.
Waits are bounded (``_wait_until``, ``timeout=``), so a bug fails instead of
hanging.
"""

import functools
import itertools
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
from jaxstreams import _compat
from jaxstreams.staging import _clock, _policy, _transfer
from jaxstreams.staging import BY_PLATFORM_TRANSFER, Prefetcher
from programs import (FlippingChooser, jaxstreams_threads, meter_for,
                      keyboard_interrupt_after, wait_until)

PATHS = ["device_put", "stage_area"]


# The ways items are produced: always by workers, always inline, and
# mode="measured" switching every two items.
WAYS = ["workers", "inline", "switching"]


class StuckSource:
  """A generator source that yields ``before``, then waits inside its
  ``__next__`` (``entered`` set) until ``release`` is set, then yields
  ``after``; ``finished`` is set when it is closed or ends."""

  def __init__(self, before, after):
    self.entered, self.release, self.finished = (
        threading.Event(), threading.Event(), threading.Event())
    self.generator = self._run(before, after)

  def _run(self, before, after):
    try:
      for v in before:
        yield np.int32(v)
      self.entered.set()
      self.release.wait(30)
      for v in after:
        yield np.int32(v)
    finally:
      self.finished.set()


@pytest.fixture(params=WAYS)
def way(request, monkeypatch):
  """The ``mode=`` to pass for one way of producing items."""
  if request.param == "switching":
    monkeypatch.setattr(_policy, "Chooser", FlippingChooser)
    return "measured"
  return request.param


def test_items_in_order_on_device(way):
  batches = [{"x": np.full((2, 3), i, np.float32), "y": np.int32(i)}
             for i in range(7)]
  with jaxstreams.prefetch(batches, size=3, mode=way) as it:
    out = list(it)
  assert len(out) == 7
  for i, item in enumerate(out):
    assert set(item) == {"x", "y"}
    assert isinstance(item["x"], jax.Array) and isinstance(item["y"], jax.Array)
    np.testing.assert_array_equal(item["x"], batches[i]["x"])
    assert int(item["y"]) == i


def test_end_stops_workers_without_close(way):
  it = jaxstreams.prefetch(iter(range(3)), size=2, num_threads=2, mode=way)
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

  with jaxstreams.prefetch(source(), size=size, mode="workers") as it:
    for i in range(40):
      if i in (0, 10, 11, 25):
        # Give the worker every chance to run ahead: it must stop at `size`
        # (it fills the lookahead at the start; later it is woken to refill
        # once the lookahead is half empty, so it may be short of full).
        # The sleep only gives an overrun time to show; no bound needs it.
        assert wait_until(lambda: len(pulled) >= (size if i == 0 else i + 1))
        time.sleep(0.05)
        assert (len(pulled) == size) if i == 0 else (
            i < len(pulled) <= i + size)
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


def test_exception_at_item_k_after_earlier_items(way):
  def source():
    yield np.int32(0)
    yield np.int32(1)
    raise ValueError("bad record 2")

  it = jaxstreams.prefetch(source(), size=4, mode=way)
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


def test_ignored_exception_types_skip_items(way):
  source = _Records(12, {2: KeyError("x"), 5: KeyError("y"), 6: KeyError()})
  with jaxstreams.prefetch(source, size=2, mode=way,
                           ignored_exception_types=(KeyError,)) as it:
    assert [int(x) for x in it] == [0, 1, 3, 4, 7, 8, 9, 10, 11]


def test_closed_exception_types_end_cleanly(way):
  source = _Records(8, {5: EOFError("done")})
  with jaxstreams.prefetch(source, size=2, mode=way,
                           closed_exception_types=(EOFError,)) as it:
    assert [int(x) for x in it] == [0, 1, 2, 3, 4]
  assert source.i == 6   # nothing pulled past the end


def test_placement_error_is_delivered_at_its_item(way):
  items = [np.int32(0), np.int32(1), np.int32(2), object(), np.int32(4)]
  it = jaxstreams.prefetch(items, size=2, mode=way)
  assert [int(next(it)) for _ in range(3)] == [0, 1, 2]
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


def _counting(finished: threading.Event):
  """0, 1, 2, ... without end; ``finished`` is set when it is closed."""
  try:
    i = 0
    while True:
      yield np.int32(i)
      i += 1
  finally:
    finished.set()


def test_close_stops_infinite_source_and_runs_generator_finally(way):
  finished = threading.Event()
  it = jaxstreams.prefetch(_counting(finished), size=2, num_threads=3, mode=way)
  assert [int(next(it)) for _ in range(5)] == [0, 1, 2, 3, 4]
  assert len(it.threads) == (0 if way == "inline" else 3)
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
  source = StuckSource(before=[0], after=[1, 2])
  entered, release, finished = source.entered, source.release, source.finished
  it = jaxstreams.prefetch(source.generator, size=2, mode="workers")
  assert int(next(it)) == 0
  assert entered.wait(10)
  t0 = time.monotonic()
  assert it.close(timeout=0.05) is False
  assert time.monotonic() - t0 < 5   # returned: it does not wait for the worker
  assert it.threads[0].is_alive() and not finished.is_set()
  with pytest.raises(StopIteration):
    next(it)            # closed: nothing more is handed out
  release.set()
  assert wait_until(lambda: not it.threads[0].is_alive())
  assert wait_until(finished.is_set)
  assert it.close(timeout=1) is True
  with pytest.raises(StopIteration):
    next(it)


def test_close_from_another_thread_while_the_consumer_produces_inline():
  """Inline, the consumer's own thread is inside the iterable: close(timeout)
  from elsewhere returns False; when the iterable returns, that next()
  hands out nothing (StopIteration) and closes the generator."""
  source = StuckSource(before=[0], after=[1])
  entered, release, finished = source.entered, source.release, source.finished
  it = jaxstreams.prefetch(source.generator, mode="inline")
  assert int(next(it)) == 0
  outcome = []

  def consume():
    try:
      outcome.append(next(it))
    except BaseException as e:  # noqa: BLE001
      outcome.append(e)

  consumer = threading.Thread(target=consume)
  consumer.start()
  assert entered.wait(10)
  assert it.close(timeout=0.05) is False
  assert not finished.is_set()
  release.set()
  consumer.join(10)
  assert len(outcome) == 1 and isinstance(outcome[0], StopIteration)
  assert wait_until(finished.is_set)
  assert it.close(timeout=1) is True


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "1", True])
def test_close_timeout_must_be_a_positive_number(timeout):
  with jaxstreams.prefetch([np.zeros(2)]) as it:
    with pytest.raises((TypeError, ValueError),
                       match="Prefetcher.close: timeout"):
      it.close(timeout=timeout)


def test_context_manager_stops_workers_on_error(way):
  def forever():
    while True:
      yield np.zeros(4)

  with pytest.raises(RuntimeError, match="user code"):
    with jaxstreams.prefetch(forever(), size=2, num_threads=2, mode=way) as it:
      for _ in range(5):
        next(it)
      raise RuntimeError("user code")
  assert not any(t.is_alive() for t in it.threads)


def test_abandoned_iterator_stops_when_collected(way):
  def forever():
    while True:
      yield np.zeros(4)

  before = len(jaxstreams_threads("jaxstreams-prefetch"))
  it = jaxstreams.prefetch(forever(), size=2, num_threads=2, mode=way)
  for _ in range(5):
    next(it)
  started = 0 if way == "inline" else 2
  assert len(jaxstreams_threads("jaxstreams-prefetch")) == before + started
  del it
  gc.collect()
  assert wait_until(
      lambda: len(jaxstreams_threads("jaxstreams-prefetch")) == before, 10.0)


def test_prefetcher_over_a_prefetcher_keeps_order_and_closes_both(way):
  """The outer iterator owns the inner one: items come through both in
  order, and closing the outer (even with its worker waiting on the inner)
  stops the inner's workers and runs the source's finally."""
  finished = threading.Event()
  inner = jaxstreams.prefetch(_counting(finished), size=2, num_threads=2,
                              mode=way)
  outer = jaxstreams.prefetch(inner, size=3, mode=way)
  assert [int(next(outer)) for _ in range(6)] == list(range(6))
  assert outer.close(timeout=10) is True
  assert not any(t.is_alive() for t in inner.threads + outer.threads)
  assert finished.is_set()
  with pytest.raises(StopIteration):
    next(inner)


def test_closing_the_outer_prefetcher_wakes_its_worker_waiting_on_the_inner():
  """The outer's worker waits inside the inner iterator for an item the
  source does not give: closing the outer stops the inner, so that worker
  returns at once; close(timeout) then waits for the inner's worker, stuck
  in the source, gives up after its timeout, and the inner's worker ends
  (closing the source) once the source returns."""
  source = StuckSource(before=[0, 1], after=[2])
  entered, release, finished = source.entered, source.release, source.finished
  inner = jaxstreams.prefetch(source.generator, size=1, mode="workers")
  outer = jaxstreams.prefetch(inner, size=2, mode="workers")
  assert [int(next(outer)) for _ in range(2)] == [0, 1]
  assert entered.wait(10)     # the outer's worker now waits on the inner
  t0 = time.monotonic()
  assert outer.close(timeout=0.5) is False
  assert time.monotonic() - t0 < 5
  assert not any(t.is_alive() for t in outer.threads)
  assert inner.threads[0].is_alive() and not finished.is_set()
  release.set()
  assert wait_until(lambda: not any(t.is_alive() for t in inner.threads))
  assert wait_until(finished.is_set)


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
    (dict(timeout=-1), ValueError,
     "timeout must be > 0 seconds or None, got -1"),
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


def test_mode_argument():
  with pytest.raises(ValueError, match=r"mode must be one of \('measured', "
                                       r"'workers', 'inline'\), got 'threads'"):
    jaxstreams.prefetch([1], mode="threads")
  with pytest.raises(ValueError, match=r"mode must be one of \('measured', "
                                       r"'workers', 'inline'\), got 'auto'"):
    jaxstreams.prefetch([1], mode="auto")
  with pytest.raises(ValueError, match="mode='inline' cannot honour "
                                       "timeout=1.0"):
    jaxstreams.prefetch([1], mode="inline", timeout=1)
  # measured with a timeout: workers, since only a wait for one can time out.
  with jaxstreams.prefetch([np.ones(2)], timeout=5) as it:
    stats = it.stats()
    assert stats["mode"] == "workers" and "timeout=5" in stats["mode_reason"]
    assert it.mode == "measured" and "mode='measured' (workers)" in repr(it)
  with jaxstreams.prefetch([np.ones(2)]) as it:
    assert it.stats()["mode"] == "inline" and it.threads == []
  with jaxstreams.prefetch([np.ones(2)], mode="workers") as it:
    assert it.stats()["mode_reason"] == "mode='workers' was asked for"


def test_single_exception_class_accepted():
  source = _Records(4, {1: KeyError("x")})
  with jaxstreams.prefetch(source, ignored_exception_types=KeyError) as it:
    assert [int(x) for x in it] == [0, 2, 3]


# The stage-area path ---------------------------------------------------------


def _assert_destroyed(area):
  with pytest.raises(rt.RuntimeOpError,
                     match=rf"stage {area.id} was destroyed"):
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
      assert (jax.tree_util.tree_structure(got)
              == jax.tree_util.tree_structure(ref))
      for g, r in zip(jax.tree_util.tree_leaves(got),
                      jax.tree_util.tree_leaves(ref)):
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
                           mode="workers") as it:
    for i in range(30):
      if i in (0, 10):
        assert wait_until(lambda: len(pulled) >= (size if i == 0 else i + 1))
        time.sleep(0.05)       # (refilled once half empty: see above)
        assert (len(pulled) == size) if i == 0 else (
            i < len(pulled) <= i + size)
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
      {"x": np.full((4, 2), 7, np.float64), "n": np.int64(7)},  # canonical:
                                                                # fits
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
      assert (jax.tree_util.tree_structure(got)
              == jax.tree_util.tree_structure(ref))
      for g, r in zip(jax.tree_util.tree_leaves(got),
                      jax.tree_util.tree_leaves(ref)):
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
                           transfer="stage_area", mode="workers")
  assert [int(next(it)[0]) for _ in range(5)] == [0, 1, 2, 3, 4]
  area = it.stage
  assert wait_until(lambda: area.stats().queued == 1)
  it.close()
  assert not any(t.is_alive() for t in it.threads)
  _assert_destroyed(area)

  # Abandoned: collected while the worker waits on a full pipeline.
  before = len(jaxstreams_threads("jaxstreams-prefetch"))
  it = jaxstreams.prefetch(forever(), size=2, num_threads=2,
                           transfer="stage_area", mode="workers")
  next(it)
  area = it.stage
  del it
  gc.collect()
  assert wait_until(
      lambda: len(jaxstreams_threads("jaxstreams-prefetch")) == before, 10.0)
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
  with pytest.raises(ValueError, match=r"transfer must be one of "
                     r"\['by_platform', 'device_put', 'stage_area'\], got "
                     r"'pinned'"):
    jaxstreams.prefetch([1], transfer="pinned")
  with pytest.raises(ValueError, match=r"transfer must be one of "
                     r"\['by_platform', .*got 'auto'"):
    jaxstreams.prefetch([1], transfer="auto")
  with pytest.raises(ValueError, match="transfer='stage_area' cannot be used "
                                       "here: it places items on jax's "
                                       "default"):
    jaxstreams.prefetch([1], sharding=jax.devices()[0], transfer="stage_area")
  # by_platform: the table's choice for this backend, device_put with a
  # sharding.
  with jaxstreams.prefetch([np.ones(2)]) as it:
    assert it.transfer == BY_PLATFORM_TRANSFER[jax.default_backend()]
  with jaxstreams.prefetch([np.ones(2)], sharding=jax.devices()[0]) as it:
    assert it.transfer == "device_put"
  assert BY_PLATFORM_TRANSFER["gpu"] == "device_put"  # not measured


def test_describing_the_iterable_prints_no_item():
  """The iterable is described for error messages by its type and length:
  printing items (even a few large arrays) cost tens of ms per prefetch()."""
  printed = []

  class Item(np.ndarray):
    def __repr__(self):
      printed.append(1)
      return "Item"

  items = [np.zeros(4, np.float32).view(Item) for _ in range(200)]
  with jaxstreams.prefetch(items, size=2, mode="workers") as it:
    assert len(list(it)) == 200
    assert "list of 200 item(s)" in repr(it)
  assert not printed




def test_stage_area_across_switches(way):
  """Items that fit the area and items that do not, in order, bit for bit,
  whoever places them; the area is gone at the end."""
  items = [{"x": np.full((4,), i, np.float32), "n": np.int32(i)}
           if i % 3 else {"x": np.full((4,), i, np.float32), "n": i}
           for i in range(14)]
  with jaxstreams.prefetch(items, size=2, transfer="stage_area",
                           mode=way) as it:
    out = list(it)
    area = it.stage
  assert [int(o["x"][0]) for o in out] == list(range(14))
  for got, item in zip(out, items):
    ref = jax.device_put(item)
    for g, r in zip(jax.tree_util.tree_leaves(got),
                    jax.tree_util.tree_leaves(ref)):
      assert _bits(g) == _bits(r) and g.weak_type == r.weak_type
  assert it.placed == {"stage_area": 9, "device_put": 5}
  _assert_destroyed(area)


# Every promise, whoever produces the items -----------------------------------


def test_lookahead_bound_holds_across_switches(way):
  size = 2
  lock = threading.Lock()
  pulled, delivered, ahead = [0], [0], []

  def source():
    for i in range(30):
      with lock:
        pulled[0] += 1
        ahead.append(pulled[0] - delivered[0])
      yield np.full(3, i, np.float32)

  with jaxstreams.prefetch(source(), size=size, mode=way) as it:
    for i, item in enumerate(it):
      assert int(item[0]) == i
      with lock:
        delivered[0] += 1
  assert max(ahead) <= size + 1   # counted outside the lock: see above
  assert it.max_in_flight <= size


@pytest.mark.parametrize("error", [ValueError("bad record 6"),
                                   KeyboardInterrupt("producer interrupted")])
def test_error_at_item_k_is_raised_once_earlier_items_arrive(way, error):
  closed = threading.Event()
  pulled = []

  def source():
    try:
      for i in range(20):
        pulled.append(i)
        if i == 6:
          raise error
        yield np.int32(i)
    finally:
      closed.set()

  it = jaxstreams.prefetch(source(), size=3, num_threads=2, mode=way)
  got = []
  with pytest.raises(type(error), match=str(error)):
    for item in it:
      got.append(int(item))
  assert got == list(range(6))
  assert pulled == list(range(7))       # nothing pulled past the failure
  assert not any(t.is_alive() for t in it.threads)
  assert closed.is_set()
  with pytest.raises(StopIteration):
    next(it)


def test_keyboard_interrupt_in_the_consumer_while_an_item_is_produced(way):
  """Ctrl-C while next() is busy with item 5 (waiting for a worker, or
  inside the iterable in the consumer's own thread): it propagates, the
  workers are gone, the generator is closed, later calls end."""
  release, closed = threading.Event(), threading.Event()

  def source():
    try:
      for i in range(20):
        if i == 5:
          release.wait(10)
        yield np.int32(i)
    finally:
      closed.set()

  it = jaxstreams.prefetch(source(), size=2, mode=way)
  got = [int(next(it)) for _ in range(5)]
  with pytest.raises(KeyboardInterrupt):
    # With the interrupt, a blocked worker gets out.
    with keyboard_interrupt_after(0.05, then=release.set):
      got.append(int(next(it)))
  assert got == [0, 1, 2, 3, 4]
  assert not any(t.is_alive() for t in it.threads)
  assert wait_until(closed.is_set)
  with pytest.raises(StopIteration):
    next(it)


def test_two_consumers_share_one_iterator(way):
  """Each item goes to exactly one of two threads calling next()."""
  items = [np.int32(i) for i in range(200)]
  out = [[], []]

  def consume(mine):
    for item in it:
      mine.append(int(item))

  with jaxstreams.prefetch(items, size=3, mode=way) as it:
    threads = [threading.Thread(target=consume, args=(out[k],))
               for k in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(30)
  assert not any(t.is_alive() for t in threads)
  assert sorted(out[0] + out[1]) == list(range(200))
  assert out[0] == sorted(out[0]) and out[1] == sorted(out[1])


def test_stats_say_which_way_it_runs(way):
  batches = [np.full(3, i, np.float32) for i in range(40)]
  with jaxstreams.prefetch(batches, size=2, mode=way) as it:
    assert it.stats()["items"] == 0
    got = [int(b[0]) for b in it]
    stats = it.stats()
  assert got == list(range(40))
  assert stats["items"] == 40
  assert stats["workers"]["items"] + stats["inline"]["items"] == 40
  if way == "workers":
    assert stats["mode"] == "workers" and stats["inline"]["items"] == 0
  elif way == "inline":
    assert stats["mode"] == "inline" and stats["workers"]["items"] == 0
    assert it.threads == []
  else:
    # A switch every second judged item of 39 cycles; after a switch to
    # inline, the items workers had made (up to size=2) are not judged:
    # two switches take 6 items at most.
    assert 2 * (39 // 6) <= stats["switches"] <= 19
    assert stats["mode_reason"] == "switching (test)"
    assert stats["workers"]["items"] > 0 and stats["inline"]["items"] > 0
  for per in (stats["workers"], stats["inline"]):
    for key in ("wait_us", "handoff_us", "produce_us", "cycle_us"):
      assert per[key] >= 0


# How mode="measured" chooses: the chooser fed made-up times -----------------

# The chooser as prefetch words it.
Chooser = functools.partial(_policy.Chooser, words=_policy.PREFETCH_WORDS,
                            steady_s=_policy.PREFETCH_STEADY_S)
WINDOW = _policy.WINDOW
US = 1e-6


def _feed(chooser, n, cycle_us, produce_us, inline_made=None, wait_us=0.0,
          busy_us=0.0):
  """Shows ``chooser`` n items, through the ``Meter`` the pipeline shows
  them through (``meter_for``); returns the modes it switched to."""
  meter = meter_for(chooser)
  switched = []
  for _ in range(n):
    made = chooser.inline if inline_made is None else inline_made
    if meter.count("inline" if made else "workers", 0.0, wait_us * US,
                   produce_us * US, made, meter.last + cycle_us * US,
                   busy=busy_us * US):
      switched.append(chooser.mode)
  return switched


def test_chooser_stays_inline_where_production_is_cheap():
  chooser = Chooser(ahead=2)
  assert chooser.mode == "inline" and "judging" in chooser.reason
  # A small share of the cycle (after the first window of WINDOW items,
  # windows of _policy.PREFETCH_STEADY_S: 100 items of 1 ms) ...
  steady = round(_policy.PREFETCH_STEADY_S / 1e-3)
  assert _feed(chooser, 2 + WINDOW + steady, cycle_us=1000,
               produce_us=50) == []
  assert chooser.mode == "inline" and not chooser.trials
  assert (f"5.0% of a cycle (50 us of 1000 us, over {steady} items)"
          in chooser.reason)
  # ... told once, at the first window.
  assert meter_for(chooser).news == chooser.reason.replace(
      f"over {steady} items", f"over {WINDOW} items")
  meter_for(chooser).news = None
  # ... or a large share, but less than a worker costs (a consumer that
  # does not wait for its results has short cycles).
  assert _feed(chooser, steady, cycle_us=20, produce_us=15) == []
  assert chooser.mode == "inline"
  assert "takes 15 us (15 us of 20 us" in chooser.reason
  assert meter_for(chooser).news is None             # ... and only once


def test_chooser_ignores_the_first_items():
  chooser = Chooser(ahead=2)
  # Two slow first items (compiling) do not count.
  assert _feed(chooser, 2, cycle_us=10_000, produce_us=9_000) == []
  assert chooser.mode == "inline"


def test_chooser_moves_to_workers_at_once_when_production_dominates():
  chooser = Chooser(ahead=2)
  assert _feed(chooser, 4, cycle_us=1000, produce_us=600) == ["workers"]
  assert chooser.mode == "workers" and "60% of a cycle" in chooser.reason
  assert meter_for(chooser).news is None             # nothing to warn about
  # Workers keep it while production is hidden (the consumer still waits).
  assert _feed(chooser, 10 * WINDOW, cycle_us=700, produce_us=600,
               wait_us=100) == []
  # A share that large is not enough when an item is cheap, nor is an
  # expensive item that is a small share of a long step.
  for cycle, produce in ((100, 60), (10_000, 300)):
    chooser = Chooser(ahead=2)
    assert _feed(chooser, 4, cycle_us=cycle, produce_us=produce) == []


def test_chooser_steps_aside_when_production_turns_cheap():
  chooser = Chooser(ahead=2)
  _feed(chooser, 4, cycle_us=1000, produce_us=600)
  assert chooser.mode == "workers"
  # The first size + 1 items after the switch (the lookahead filling) do
  # not count; then a window of cheap production.
  assert _feed(chooser, 3 + WINDOW, cycle_us=1000, produce_us=10) == ["inline"]
  assert "fell to 1.0% of a cycle" in chooser.reason
  assert meter_for(chooser).news == chooser.reason
  # Also when an item turns cheaper than a worker costs.
  chooser = Chooser(ahead=2)
  _feed(chooser, 4, cycle_us=1000, produce_us=600)
  assert _feed(chooser, 3 + WINDOW, cycle_us=50, produce_us=10) == ["inline"]


def test_chooser_keeps_workers_while_the_consumer_waits_for_them():
  chooser = Chooser(ahead=2)
  _feed(chooser, 4, cycle_us=1000, produce_us=600)
  # The lookahead fills (3 items), a first window, then two of STEADY_S.
  steady = round(_policy.PREFETCH_STEADY_S / 1e-3)
  _feed(chooser, 3 + WINDOW + 2 * steady, cycle_us=1000, produce_us=10,
        wait_us=2)
  assert chooser.mode == "workers"
  # Unless it waits as long as producing takes: inline would cost no more.
  assert _feed(chooser, steady, cycle_us=1000, produce_us=10,
               wait_us=11) == ["inline"]
  assert (f"the consumer waited for {steady} of {steady} items"
          in chooser.reason)


def _trial(chooser, workers_cycle_us, inline_cycle_us, produce_us):
  """Runs a trial that has just started, window by window."""
  modes = []
  while chooser.trial is not None:
    cycle = workers_cycle_us if chooser.mode == "workers" else inline_cycle_us
    modes.append(chooser.mode)
    _feed(chooser, 1, cycle_us=cycle, produce_us=produce_us)
  return modes


def test_chooser_trial_keeps_workers_when_they_are_faster():
  chooser = Chooser(ahead=2)
  # 30% of a cycle: worth a trial, not sure enough to skip one.
  assert _feed(chooser, 2 + WINDOW, cycle_us=1000, produce_us=300) == [
      "workers"]
  assert chooser.reason.startswith("trial")
  modes = _trial(chooser, workers_cycle_us=750, inline_cycle_us=1000,
                 produce_us=300)
  # Rounds of a worker window then an inline window (the worker windows
  # also skip the size + 1 items that refill the lookahead), two of the
  # three: after two wins the third cannot change the result.
  assert modes.count("workers") == 2 * (WINDOW + 3)
  assert modes.count("inline") == 2 * WINDOW
  assert chooser.mode == "workers"
  assert chooser.trials == [{"workers_cycle_us": pytest.approx(750),
                             "inline_cycle_us": pytest.approx(1000),
                             "workers_won": 2, "rounds": 2,
                             "chose": "workers", "stopped_early": False}]
  assert "a trial found them faster" in chooser.reason
  assert meter_for(chooser).news is None


@pytest.mark.parametrize("workers_cycles_us, chose", [
    ((750, 1250, 750), "workers"), ((750, 1250, 1250), "inline")])
def test_chooser_trial_runs_a_third_round_after_a_split(workers_cycles_us,
                                                       chose):
  chooser = Chooser(ahead=2)
  _feed(chooser, 2 + WINDOW, cycle_us=1000, produce_us=300)
  windows = iter(workers_cycles_us)
  while chooser.trial is not None:
    cycle = next(windows)
    while chooser.trial is not None and chooser.mode == "workers":
      _feed(chooser, 1, cycle_us=cycle, produce_us=300)
    while chooser.trial is not None and chooser.mode == "inline":
      _feed(chooser, 1, cycle_us=1000, produce_us=300)
  assert next(windows, None) is None       # all three rounds ran
  assert chooser.mode == chose
  assert chooser.trials[-1]["rounds"] == 3
  assert chooser.trials[-1]["workers_won"] == (2 if chose == "workers" else 1)


def _trial_with_stalls(every, stall_us):
  """A trial at 0.1 ms cycles, workers 10% faster, where every ``every``-th
  counted item of each workers window takes ``stall_us`` longer."""
  chooser = Chooser(ahead=2)
  _feed(chooser, 2 + WINDOW, cycle_us=100, produce_us=40)
  assert chooser.trial is not None
  count = 0
  while chooser.trial is not None:
    cycle = 100
    counted = meter_for(chooser).window is not None
    if chooser.mode == "workers" and counted:
      count += 1
      cycle = 90 + (stall_us if count % every == 0 else 0)
    _feed(chooser, 1, cycle_us=cycle, produce_us=40)
  return chooser


def test_chooser_trial_is_not_decided_by_one_preempted_item():
  # One item per workers window preempted for a millisecond (a shared
  # machine): the window's mean would lose by half; the trial still sees
  # the workers' 10%.
  chooser = _trial_with_stalls(every=WINDOW, stall_us=1000)
  assert chooser.mode == "workers"
  assert chooser.trials[-1]["workers_won"] == chooser.trials[-1]["rounds"]
  assert chooser.trials[-1]["workers_cycle_us"] == pytest.approx(90)


def test_chooser_trial_counts_a_stall_that_recurs():
  # Every 4th item waits 200 us under workers: that is their cost, and
  # the trial finds them slower.
  chooser = _trial_with_stalls(every=4, stall_us=200)
  assert chooser.mode == "inline"
  assert chooser.trials[-1]["workers_won"] == 0


def test_chooser_trial_steps_aside_when_workers_are_no_faster():
  chooser = Chooser(ahead=2)
  _feed(chooser, 2 + WINDOW, cycle_us=200, produce_us=44)
  _trial(chooser, workers_cycle_us=280, inline_cycle_us=200, produce_us=44)
  assert chooser.mode == "inline"
  assert chooser.trials[-1]["chose"] == "inline"
  news = meter_for(chooser).news
  assert news and "a trial found workers no faster" in news
  # The same production share does not start another trial ...
  assert _feed(chooser, 50 * WINDOW, cycle_us=200, produce_us=44) == []
  assert "a trial found workers no faster at 22%" in chooser.reason
  # (Windows of _policy.PREFETCH_STEADY_S here: 500 items of 200 us.)
  steady = round(_policy.PREFETCH_STEADY_S / 200e-6)
  assert chooser.steady == steady
  assert _feed(chooser, 3 * steady, cycle_us=200, produce_us=80) == []
  # ... doubled, it does (once enough items have passed since the last).
  for _ in range(2 * steady):
    if _feed(chooser, 1, cycle_us=200, produce_us=90):
      break
  assert chooser.trial is not None and chooser.reason.startswith("trial")


def test_chooser_trial_ends_early_when_workers_are_plainly_slower():
  chooser = Chooser(ahead=2)
  _feed(chooser, 2 + WINDOW, cycle_us=1000, produce_us=300)
  assert chooser.mode == "workers" and chooser.trial is not None
  # The lookahead refills (size + 1 items, not judged), then EARLY_ITEMS
  # items at 1.6 times inline's cycle: the trial ends, lost, without
  # running the rest of its windows (a 32-step loop would otherwise spend
  # most of itself in the slower way).
  early = 3 + _policy.EARLY_ITEMS
  assert _feed(chooser, early, cycle_us=1600, produce_us=300) == ["inline"]
  assert chooser.trial is None and chooser.mode == "inline"
  assert chooser.trials == [{"workers_cycle_us": pytest.approx(1600),
                             "inline_cycle_us": pytest.approx(1000),
                             "workers_won": 0, "rounds": 1,
                             "chose": "inline", "stopped_early": True}]
  assert "stopped after 4 items" in chooser.reason
  assert meter_for(chooser).news == chooser.reason
  # Workers a little slower at first are given the whole window.
  chooser = Chooser(ahead=2)
  _feed(chooser, 2 + WINDOW, cycle_us=1000, produce_us=300)
  assert _feed(chooser, early, cycle_us=1400, produce_us=300) == []
  assert chooser.mode == "workers" and chooser.trial is not None


def test_chooser_goes_back_inline_when_workers_taken_at_once_are_slower():
  chooser = Chooser(ahead=2)
  # Production dominates a short cycle (a loop that does not read its
  # results): workers at once ...
  assert _feed(chooser, 4, cycle_us=300, produce_us=250) == ["workers"]
  # ... but on this machine they make each cycle twice as long: back
  # inline after the refill and EARLY_ITEMS items, recorded as a lost trial.
  early = 3 + _policy.EARLY_ITEMS
  assert _feed(chooser, early, cycle_us=600, produce_us=250) == ["inline"]
  assert chooser.trials == [{"workers_cycle_us": pytest.approx(600),
                             "inline_cycle_us": pytest.approx(300),
                             "workers_won": 0, "rounds": 1,
                             "chose": "inline", "stopped_early": True}]
  assert "a trial found workers no faster" in chooser.reason
  assert "stopped after 4 items" in chooser.reason
  assert meter_for(chooser).news == chooser.reason        # told once
  # The same share does not move it at once again (no back and forth) ...
  assert _feed(chooser, 20 * WINDOW, cycle_us=300, produce_us=250) == []
  assert chooser.mode == "inline"


def test_chooser_keeps_workers_taken_at_once_that_are_not_plainly_slower():
  chooser = Chooser(ahead=2)
  assert _feed(chooser, 4, cycle_us=1000, produce_us=600) == ["workers"]
  # Slower at first by less than EARLY_LOSS: the window runs whole, and
  # then workers stay while production is worth hiding.
  assert _feed(chooser, 3 + WINDOW, cycle_us=1400, produce_us=600,
               wait_us=100) == []
  assert chooser.mode == "workers" and not chooser.trials


def _feed_busy(chooser, n, cycle_us, produce_us, busy_us):
  """Shows ``chooser`` n items made inline, ``busy_us`` of each item's
  production CPU time; returns the modes it switched to."""
  return _feed(chooser, n, cycle_us, produce_us, inline_made=True,
               busy_us=busy_us)


def test_chooser_on_shared_cores_leaves_out_placing_that_needs_a_core():
  # XLA:CPU: placing an item that keeps a core busy (copying a large item)
  # would compete with the step: however large a share, it stays inline,
  # without a trial, and says why.
  chooser = Chooser(ahead=2, shares_cores=True)
  assert _feed_busy(chooser, 2 + 8 * WINDOW, cycle_us=800, produce_us=400,
                    busy_us=395) == []
  assert chooser.mode == "inline" and not chooser.trials
  assert chooser.reason.startswith(
      "placing each item mostly needs a core (5 us of 800 us, over 16 "
      "items; not counted: the 395 us of placing it that needs a core, "
      "which the step needs too here)")
  assert meter_for(chooser).news == chooser.reason
  # Production whose placing waits (or that the iterable makes) is hidden
  # at once ...
  chooser = Chooser(ahead=2, shares_cores=True)
  assert _feed_busy(chooser, 4, cycle_us=1000, produce_us=600,
                    busy_us=20) == ["workers"]
  assert "58% of a cycle (580 us of 1000 us" in chooser.reason
  # ... and a mix whose waiting part is a middling share runs a trial.
  chooser = Chooser(ahead=2, shares_cores=True)
  assert _feed_busy(chooser, 2 + WINDOW, cycle_us=1000, produce_us=600,
                    busy_us=300) == ["workers"]
  assert chooser.trial is not None and "30% of a cycle" in chooser.reason
  # Where the device has cores of its own (a GPU), CPU time is production
  # like any other: the same items move at once.
  chooser = Chooser(ahead=2)
  assert _feed_busy(chooser, 4, cycle_us=800, produce_us=400,
                    busy_us=395) == ["workers"]


def test_chooser_with_the_dispatch_gap_tries_workers_at_short_cycles():
  # XLA:CPU with asynchronous dispatch and a lookahead that wakes a worker
  # rarely: cheap production (a 4 us placement, all of it needing a core)
  # decides nothing at cycles under unseen_cycle_s; a trial does.
  def gap_chooser():
    return Chooser(ahead=16, shares_cores=True, unseen_gain=True,
                   unseen_cycle_s=1000 * US)
  chooser = gap_chooser()
  assert _feed_busy(chooser, 2 + WINDOW, cycle_us=110, produce_us=4,
                    busy_us=4) == ["workers"]
  assert chooser.trial is not None and meter_for(chooser).news is None
  assert chooser.reason.startswith(
      "trial: on CPU with asynchronous dispatch the consumer's own time "
      "between steps")
  # Workers that shorten the cycle win it and stay, though production is
  # cheap (no stepping aside while they run) ...
  _trial(chooser, workers_cycle_us=100, inline_cycle_us=115, produce_us=0)
  assert chooser.mode == "workers" and chooser.trials[-1]["chose"] == (
      "workers")
  assert _feed(chooser, 3 * WINDOW, cycle_us=100, produce_us=4) == []
  assert chooser.mode == "workers"
  # ... and workers that do not (a loop that does not read its results)
  # lose it: inline, told once.
  chooser = gap_chooser()
  _feed_busy(chooser, 2 + WINDOW, cycle_us=90, produce_us=4, busy_us=4)
  _trial(chooser, workers_cycle_us=95, inline_cycle_us=90, produce_us=0)
  assert chooser.mode == "inline" and chooser.trials[-1]["chose"] == (
      "inline")
  assert meter_for(chooser).news is not None
  assert meter_for(chooser).news_cycle == pytest.approx(90 * US)
  # At long cycles the same production stays inline without a trial; so
  # it does without the gain (synchronous dispatch, a small lookahead).
  for chooser, cycle_us in ((gap_chooser(), 2000),
                            (Chooser(ahead=2, shares_cores=True), 110)):
    assert _feed_busy(chooser, 2 + 4 * WINDOW, cycle_us=cycle_us,
                      produce_us=4, busy_us=4) == []
    assert chooser.mode == "inline" and not chooser.trials


@pytest.mark.cpu_backend
def test_prefetch_expects_the_dispatch_gap_only_where_it_can_pay(
    monkeypatch):
  # The chooser is told of the gain on CPU with asynchronous dispatch, at
  # any lookahead, in mode="measured" only.
  items = [np.ones(2, np.float32)] * 3

  def gain(**kwargs):
    with jaxstreams.prefetch(items, **kwargs) as it:
      chooser = it._pipeline.meter.chooser
      return None if chooser is None else chooser.unseen_gain

  assert gain() is True                       # the default size=2
  assert gain(size=1) is True
  assert gain(size=16) is True
  assert gain(mode="inline") is None
  monkeypatch.setattr(_compat, "cpu_dispatch_is_async", lambda: False)
  assert gain() is False


def test_busy_tells_waiting_from_needing_a_core():
  # The real clocks: a sleep blocks (it needs no core: busy is the little
  # CPU time it took), a computation needs one (busy is at least the CPU
  # time it took, however long a loaded machine made it wait for a core).
  start, t0 = _clock.reading(), _clock.now()
  time.sleep(0.02)
  slept = _clock.now() - t0
  assert _clock.busy(start, slept) < 0.5 * slept
  start, t0, cpu0 = _clock.reading(), _clock.now(), _clock.cpu()
  x = np.ones(1 << 16)
  while _clock.cpu() - cpu0 < 0.02:
    x = np.sqrt(x + 1.0)
  computed = _clock.now() - t0
  assert _clock.busy(start, computed) >= 0.02


def test_chooser_counts_only_inline_items_when_inline():
  chooser = Chooser(ahead=2)
  _feed(chooser, 4, cycle_us=1000, produce_us=600)
  _feed(chooser, 3 + WINDOW, cycle_us=1000, produce_us=10)
  assert chooser.mode == "inline"
  # Items workers made before the switch say nothing about inline's cost.
  meter = meter_for(chooser)
  window = (meter.skip, list(meter.window or []))
  assert _feed(chooser, 5, cycle_us=10, produce_us=9, inline_made=False) == []
  assert meter.watched is meter.tallies["inline"]
  assert (meter.skip, list(meter.window or [])) == window


def test_chooser_trial_gap_doubles():
  # Cycles of 10 ms: RECHECK_S is fewer items than the gap here.
  chooser = Chooser(ahead=1)
  gaps = []
  for _ in range(3):
    for _ in range(10_000):      # until the next trial starts
      _feed(chooser, 1, cycle_us=10_000, produce_us=3000)
      if chooser.trial is not None:
        break
    _trial(chooser, workers_cycle_us=7500, inline_cycle_us=10_000,
           produce_us=3000)
    assert chooser.mode == "workers"
    gaps.append(chooser.next_trial - chooser.judged)
    # Back to inline: production turns cheap under workers.
    _feed(chooser, 2 + WINDOW, cycle_us=10_000, produce_us=1)
    assert chooser.mode == "inline"
  # (Counted from the trial's last window.)
  first = _policy.FIRST_TRIAL_GAP
  for k, gap in enumerate(gaps):
    assert abs(gap - first * 2**k) <= WINDOW, gaps


def test_chooser_rechecks_a_won_trial_no_sooner_than_recheck_s():
  # At 0.1 ms cycles, FIRST_TRIAL_GAP items would be 26 ms: the re-check
  # after workers won waits RECHECK_S instead; after a lost trial, only
  # the item gap applies (inline may be the worse way).
  won = Chooser(ahead=2, unseen_gain=True, unseen_cycle_s=1e-3)
  _feed(won, 2 + WINDOW, cycle_us=100, produce_us=3)
  _trial(won, workers_cycle_us=90, inline_cycle_us=100, produce_us=3)
  assert won.mode == "workers"
  expected = round(_policy.RECHECK_S / 90e-6)
  assert abs(won.next_trial - won.judged - expected) <= WINDOW
  lost = Chooser(ahead=2, unseen_gain=True, unseen_cycle_s=1e-3)
  _feed(lost, 2 + WINDOW, cycle_us=100, produce_us=3)
  _trial(lost, workers_cycle_us=110, inline_cycle_us=100, produce_us=3)
  assert lost.mode == "inline"
  expected = _policy.FIRST_TRIAL_GAP
  assert abs(lost.next_trial - lost.judged - expected) <= WINDOW


# mode="measured" in an iterator: a fake clock -------------------------------


class _FakeClock:
  """Stands in for the pipeline's clock: time moves only when a test says
  so (the source when it produces an item, the loop when it steps)."""

  def __init__(self):
    self.now = 1000.0
    self.lock = threading.Lock()

  def __call__(self):
    return self.now

  def advance(self, us):
    with self.lock:
      self.now += us * US


def _timed_source(clock, n, produce_us):
  for i in range(n):
    clock.advance(produce_us)
    yield np.full(2, i, np.float32)


@pytest.fixture
def clock(monkeypatch):
  """The pipeline's clock, replaced by a _FakeClock for the test."""
  fake = _FakeClock()
  monkeypatch.setattr(_clock, "now", fake)
  return fake


def test_short_cycle_warning_judges_the_steady_cycle_not_the_compile(
    monkeypatch, clock):
  # The first step compiles (2 s here); the note about short cycles must
  # still come, from the cycles the chooser judged. (Synchronous dispatch:
  # no trial of workers, whose fake cycles would win it.)
  monkeypatch.setattr(_compat, "cpu_dispatch_is_async", lambda: False)
  with pytest.warns(jaxstreams.PerformanceWarning) as record:
    with jaxstreams.prefetch(_timed_source(clock, 300, 5)) as it:
      for i, _ in enumerate(it):
        clock.advance(2_000_000 if i == 0 else 100)
  message = str(record[0].message)
  assert "with cycles this short (105 us)" in message
  assert "iterating the source directly" in message


@pytest.mark.cpu_backend
def test_measured_on_cpu_tries_workers_at_short_cycles(clock):
  # Cheap production (5 us) at 105 us cycles: with asynchronous dispatch
  # on CPU, a trial compares the two ways (at the default size), and order
  # and items hold across its switches.
  got = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxstreams.PerformanceWarning)
    with jaxstreams.prefetch(_timed_source(clock, 300, 5)) as it:
      for item in it:
        got.append(int(item[0]))
        clock.advance(100)
      stats = it.stats()
  assert got == list(range(300))
  assert stats["trials"] and stats["switches"] >= 2
  assert stats["workers"]["items"] > 0 and stats["inline"]["items"] > 0


@pytest.mark.cpu_backend
def test_a_lost_trial_at_short_cycles_steps_aside_once_and_says_what_helps(
    clock):
  # Workers make the (fake) step three times longer: the trial that
  # asynchronous dispatch on CPU gets at short cycles loses, and the one
  # warning says so and what helps there.
  got = []
  with pytest.warns(jaxstreams.PerformanceWarning) as record:
    with jaxstreams.prefetch(_timed_source(clock, 400, 5)) as it:
      for item in it:
        got.append(int(item[0]))
        clock.advance(100 if it._pipeline.inline else 300)
      stats = it.stats()
  assert len(record) == 1
  message = str(record[0].message)
  assert "a trial found workers no faster" in message
  assert "mode='measured' tries workers at such cycles" in message
  assert "jax_cpu_enable_async_dispatch=False" in message
  assert got == list(range(400))
  assert stats["mode"] == "inline" and stats["trials"]
  assert all(t["workers_won"] == 0 for t in stats["trials"])
  assert stats["workers"]["items"] > 0


def test_short_cycle_warning_leaves_out_async_dispatch_advice_when_sync(
    monkeypatch, clock):
  # With jax_cpu_enable_async_dispatch=False already set, the warning does
  # not tell the user to set it.
  monkeypatch.setattr(_compat, "cpu_dispatch_is_async", lambda: False)
  with pytest.warns(jaxstreams.PerformanceWarning) as record:
    with jaxstreams.prefetch(_timed_source(clock, 300, 5)) as it:
      for _ in it:
        clock.advance(100)
  message = str(record[0].message)
  assert "iterating the source directly" in message
  assert "async_dispatch" not in message and "size=16" not in message


@pytest.mark.cpu_backend
def test_measured_stays_inline_and_says_so_once_where_production_is_cheap(
    monkeypatch, clock):
  # Synchronous dispatch: nothing unseen to try workers for (the test
  # below has the trial asynchronous dispatch gets).
  monkeypatch.setattr(_compat, "cpu_dispatch_is_async", lambda: False)
  got = []
  with pytest.warns(jaxstreams.PerformanceWarning,
                    match="stepped aside: producing an item takes 5 us "
                          r"\(5 us of 105 us") as record:
    with jaxstreams.prefetch(_timed_source(clock, 300, 5)) as it:
      for item in it:
        got.append(int(item[0]))
        clock.advance(100)             # the step
      stats = it.stats()
  assert len(record) == 1
  # Cycles of 105 us: the warning says that even inline costs, and what
  # costs least.
  message = str(record[0].message)
  assert "iterating the source directly" in message
  assert got == list(range(300))
  assert stats["mode"] == "inline" and stats["switches"] == 0
  assert stats["inline"]["items"] == 300 and it.threads == []
  assert stats["inline"]["produce_us"] == pytest.approx(5)


def test_measured_moves_to_workers_where_production_dominates(monkeypatch,
                                                              clock):
  # The source waits (as for storage): it blocks at every item.
  monkeypatch.setattr(_clock, "switches", itertools.count().__next__)
  got = []
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxstreams.PerformanceWarning)
    with jaxstreams.prefetch(_timed_source(clock, 200, 1000)) as it:
      for item in it:
        got.append(int(item[0]))
        clock.advance(100)
      stats = it.stats()
  assert got == list(range(200))
  assert stats["mode"] == "workers" and stats["switches"] == 1
  assert len(it.threads) == 1 and not it.threads[0].is_alive()
  # Inline: the first item (no cycle yet), two not judged, two judged.
  assert stats["inline"]["items"] == 5


@pytest.mark.cpu_backend
def test_measured_on_cpu_hides_the_source_but_not_busy_placing(monkeypatch):
  # The device computes on the host's cores here. What the iterable does
  # for an item (computing or waiting) is hidden by workers; placing an
  # item that needs a core (a copy: computing, or waiting to be scheduled,
  # neither running nor blocked) competes with the step and stays inline;
  # placing that blocks is hidden.
  assert jax.default_backend() == "cpu"
  for where, kind, way in (("source", "computes", "workers"),
                           ("placing", "computes", "inline"),
                           ("placing", "preempted", "inline"),
                           ("placing", "blocks", "workers")):
    clock, cpu = _FakeClock(), _FakeClock()
    blocked = itertools.count()
    switches = [0]
    monkeypatch.setattr(_clock, "now", clock)
    monkeypatch.setattr(_clock, "cpu", cpu)
    monkeypatch.setattr(_clock, "switches", lambda: switches[0])

    def work():
      clock.advance(1000)
      if kind == "computes":
        cpu.advance(1000)
      elif kind == "blocks":
        switches[0] = next(blocked)

    def place(item, sharding=None, wait=True, place=_transfer.place_on_device):
      if where == "placing":
        work()
      return place(item, sharding, wait)

    monkeypatch.setattr(_transfer, "place_on_device", place)

    def source():
      for i in range(120):
        if where == "source":
          work()
        yield np.full(2, i, np.float32)

    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always", jaxstreams.PerformanceWarning)
      with jaxstreams.prefetch(source()) as it:
        got = [int(item[0]) for item in it if clock.advance(100) is None]
        stats = it.stats()
    assert got == list(range(120))
    assert stats["mode"] == way and not stats["trials"], (where, kind, stats)
    if way == "inline":
      assert "placing each item mostly needs a core" in stats["mode_reason"]
      assert it.threads == []
      # One warning; cycles of 1.1 ms are not short enough for the note
      # that even inline costs.
      [warning] = caught
      assert "mostly needs a core" in str(warning.message)
      assert "iterating the source directly" not in str(warning.message)
  # Shardings and devices on the host's cores say so too.
  device = jax.devices("cpu")[0]
  for sharding in (None, device, jax.sharding.SingleDeviceSharding(device),
                   {"a": device}):
    assert _transfer.resolve("device_put", sharding, "t")(2).shares_cores()


def test_only_the_public_prefetch_warns(monkeypatch, clock):
  # It steps aside without a trial (synchronous dispatch): a warning.
  monkeypatch.setattr(_compat, "cpu_dispatch_is_async", lambda: False)
  with Prefetcher(_timed_source(clock, 150, 5), 2, transform=lambda b: b,
                  num_threads=1, timeout=None,
                  closed_exception_types=(StopIteration,),
                  ignored_exception_types=(), mode="measured") as it:
    for _ in it:
      clock.advance(100)       # filterwarnings=error: a warning fails
    assert it.stats()["mode"] == "inline"


# Placement: jax.device_put's arrays, placed cheaply ---------------------------


def test_place_on_device_gives_what_device_put_gives():
  place = _transfer.place_on_device
  base = np.arange(24, dtype=np.float32).reshape(4, 6)
  items = [
      base, base[:, ::2], base.T, np.float32(3.5), np.int64(7),
      np.arange(5, dtype=np.float64), np.array([True, False]),
      np.asarray([1.5, 2.5], jax.numpy.bfloat16), np.zeros((0, 3), np.int8),
      np.arange(4, dtype=np.complex64),
      {"a": base, "b": [np.uint8(3), 2.0, 7]}, jax.numpy.ones(3), (),
  ]
  for item in items:
    for wait in (True, False):
      got, want = place(item, None, wait), jax.device_put(item)
      assert (jax.tree_util.tree_structure(got)
              == jax.tree_util.tree_structure(want))
      for g, w in zip(jax.tree_util.tree_leaves(got),
                      jax.tree_util.tree_leaves(want)):
        assert isinstance(g, jax.Array)
        assert _bits(g) == _bits(w) and g.weak_type == w.weak_type
        assert g.sharding == w.sharding and g.committed == w.committed
  # What device_put refuses, it refuses too (a big-endian array's bytes
  # are not read as little-endian ones).
  for bad in (np.arange(3, dtype=">f4"), np.array(["text"]), object()):
    with pytest.raises(TypeError):
      jax.device_put(bad)
    with pytest.raises(TypeError):
      place(bad, None, True)
    with pytest.raises(TypeError):
      with jaxstreams.prefetch([bad], transfer="stage_area") as it:
        next(it)
  # Copied: the producer may reuse its buffer.
  buffer = np.zeros(16, np.float32)
  placed = place(buffer, None, True)
  buffer[:] = 7
  assert float(placed[0]) == 0.0
  # jax's default device is honoured.
  devices = jax.devices()
  with jax.default_device(devices[-1]):
    assert place(base, None, True).devices() == {devices[-1]}
