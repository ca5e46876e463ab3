"""jaxstreams.prefetch: order, bounded lookahead, exceptions, timeouts,
placement, argument checks, and that no worker thread outlives its iterator.

Structure and values only: no assertion depends on how fast anything runs.
Waits are bounded (``_wait_until``, ``timeout=``), so a bug fails instead of
hanging.
"""

import gc
import random
import threading
import time

import jax
import numpy as np
import pytest

import jaxstreams
from jaxstreams.stage.prefetch import Prefetcher


def _workers():
  return [t for t in threading.enumerate()
          if t.name.startswith("jaxstreams-prefetch") and t.is_alive()]


def _wait_until(predicate, seconds=10.0):
  deadline = time.monotonic() + seconds
  while not predicate():
    if time.monotonic() > deadline:
      return False
    time.sleep(0.005)
  return True


@pytest.fixture(autouse=True)
def no_leaked_threads():
  before = set(_workers())
  yield
  assert _wait_until(lambda: set(_workers()) <= before, 10.0), _workers()


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
        assert _wait_until(lambda: len(pulled) == min(40, i + size))
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

  before = len(_workers())
  it = jaxstreams.prefetch(forever(), size=2, num_threads=2)
  next(it)
  assert len(_workers()) == before + 2
  del it
  gc.collect()
  assert _wait_until(lambda: len(_workers()) == before, 10.0)


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
