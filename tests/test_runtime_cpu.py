"""The CPU implementation of every runtime handler: in-order worker
"streams", events, stage slots in host memory, markers and the timeline.

Each test checks behaviour a user relies on (ordering, data, limits, error
messages) rather than internals. Order is read from the timeline's markers;
the only durations checked are lower bounds (a wait outlasts the sleep it
waits for), which load cannot break, and the asynchrony of ``put``, whose
bound is the sleep a synchronous put would take (see that test).
"""

import json
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams.runtime as rt
from jaxstreams.runtime import _capi, _ops, timeline

# These call the CPU runtime's handlers: programs must run on XLA:CPU.
pytestmark = pytest.mark.cpu_backend

SLOW_US = 150_000  # a slow producer: 150 ms

# What a failing handler raises from a jitted call: jax turns the handler's
# ffi::Error into JaxRuntimeError, or into a builtin for some status codes
# (OUT_OF_RANGE becomes ValueError). The message is the handler's either way.
HANDLER_ERRORS = (jax.errors.JaxRuntimeError, ValueError)


@pytest.fixture(scope="module", autouse=True)
def pool():
  return rt.init()


@pytest.fixture
def event():
  e = rt.allocate_event()
  yield e
  rt.release_event(e)


def _run(f, *args):
  return jax.block_until_ready(jax.jit(f)(*args))


def _span_ns(region):
  """Duration between the BEGIN and END markers of `region`."""
  ivs = [iv for iv in timeline.intervals(timeline.read().markers)
         if iv.region == region]
  assert len(ivs) == 1, ivs
  return ivs[0].duration_ns


def test_pool_is_created_once_with_fixed_sizes(pool):
  assert rt.init() is pool
  assert rt.init(streams=pool.streams, events=pool.events) is pool
  with pytest.raises(ValueError,
                     match="already exist with 4 streams and 1024 events"):
    rt.init(streams=pool.streams + 1)
  with pytest.raises(ValueError, match="streams must be an int >= 1"):
    rt.init(streams=0)


def test_wait_on_the_caller_orders_after_a_slow_worker(event):
  """stream 1 sleeps, marks the sleep's end, then records; the caller's wait
  must not finish before the sleep did. The same program without the wait
  does not wait: the caller's end comes before stream 1's (the caller has
  the whole sleep to get there)."""

  def program(x, with_wait):
    x = rt.delay(x, microseconds=SLOW_US, stream=1)
    x = rt.marker(x, region=9, phase=rt.INSTANT, track=1, stream=1)
    x = rt.record(x, event=event, stream=1)
    x = rt.marker(x, region=with_wait, phase=rt.BEGIN)
    if with_wait:
      x = rt.wait(x, event=event)
    return rt.marker(x, region=with_wait, phase=rt.END) + 1

  def caller_end_and_slept():
    markers = timeline.read().markers    # read() waits for the workers
    end = next(m for m in markers if m.phase == rt.END)
    slept = next(m for m in markers if m.region == 9)
    return end.t_ns, slept.t_ns

  x = jnp.arange(8.0)
  timeline.reset()
  np.testing.assert_array_equal(_run(lambda v: program(v, 1), x), x + 1)
  assert _span_ns(1) >= 0.9 * SLOW_US * 1e3
  end, slept = caller_end_and_slept()
  assert end >= slept

  rt.synchronize()  # let stream 1 drain before the control run
  timeline.reset()
  _run(lambda v: program(v, 0), x)
  end, slept = caller_end_and_slept()
  assert end < slept
  rt.synchronize()


def test_wait_on_a_worker_orders_two_workers(event):
  """stream 2 waits for an event stream 1 records after a slow task: the
  marker stream 2 then records comes after the slow task ended."""

  def program(x):
    x = rt.marker(x, region=7, phase=rt.BEGIN, track=1, stream=1)
    x = rt.delay(x, microseconds=SLOW_US, stream=1)
    x = rt.marker(x, region=7, phase=rt.END, track=1, stream=1)
    x = rt.record(x, event=event, stream=1)
    x = rt.wait(x, event=event, stream=2)
    return rt.marker(x, region=8, phase=rt.INSTANT, track=2, stream=2)

  timeline.reset()
  _run(program, jnp.zeros(4))
  markers = timeline.read().markers  # read() waits for the workers
  end_slow = next(m for m in markers if m.region == 7 and m.phase == rt.END)
  after = next(m for m in markers if m.region == 8)
  assert after.stream == 2 and end_slow.stream == 1
  assert after.t_ns >= end_slow.t_ns


def test_passthrough_keeps_values_dtypes_and_works_eagerly(event):
  a = np.arange(6, dtype=np.int16).reshape(2, 3)
  b = np.array([1.5, -0.0, np.nan], np.float32)
  out = _run(lambda x, y: rt.record(x, y, event=event), a, b)
  assert isinstance(out, tuple) and len(out) == 2
  assert out[0].dtype == a.dtype and out[0].tobytes() == a.tobytes()
  assert out[1].tobytes() == b.tobytes()
  np.testing.assert_array_equal(rt.marker(a, region=3), a)  # outside jit


def _spec():
  return {"x": jax.ShapeDtypeStruct((64,), jnp.float32),
          "ids": jax.ShapeDtypeStruct((3,), jnp.int32)}


def _item(i):
  return {"x": np.full((64,), i, np.float32) + np.arange(64, dtype=np.float32),
          "ids": np.array([i, -i, 7 * i], np.int32)}


def _assert_item(got, i):
  want = _item(i)
  np.testing.assert_array_equal(got["x"], want["x"])
  np.testing.assert_array_equal(got["ids"], want["ids"])


def test_stage_consumer_sees_a_slow_producers_data():
  """The copy into the slot is slow (delay_us); put returns at once, and the
  consumer, which waits on the slot's ready event, still sees the new data
  every time (without the event it would read the slot's previous item).
  A synchronous put would return after the copy's sleep: returning sooner
  is what asynchronous means, and a second of sleep leaves the caller, even
  on a loaded machine, all the time it needs to get past ``put``."""
  copy_us = 1_000_000
  with rt.StageArea(_spec(), capacity=2, timeout_ms=5_000) as stage:
    step = jax.jit(lambda: stage.get())
    t = time.perf_counter()
    stage.put(_item(1), delay_us=copy_us)
    assert time.perf_counter() - t < copy_us / 1e6   # put is asynchronous
    _assert_item(jax.block_until_ready(step()), 1)
    assert time.perf_counter() - t >= 0.9 * copy_us / 1e6
    for i in range(2, 6):
      stage.put(_item(i), delay_us=20_000)
      _assert_item(step(), i)


def test_stage_reuses_its_slots_in_order_and_never_grows():
  with rt.StageArea(_spec(), capacity=3, timeout_ms=5_000) as stage:
    step = jax.jit(lambda: stage.get())
    allocations = stage.stats().allocations
    stage.put(_item(0))
    stage.put(_item(1))
    slots = []
    for i in range(2, 20):
      stage.put(_item(i))
      _assert_item(step(), i - 2)  # FIFO, two items in flight
      slots.append(stage.stats().last_slot)
    _assert_item(step(), 18)
    _assert_item(step(), 19)
    stats = stage.stats()
    assert ((stats.puts, stats.gets, stats.queued, stats.free_slots)
            == (20, 20, 0, 3))
    assert stats.allocations == allocations
    assert set(slots) == {0, 1, 2}


def test_two_gets_in_one_program_are_ordered_by_after():
  with rt.StageArea(_spec(), capacity=3, timeout_ms=5_000) as stage:
    def step():
      first = stage.get()
      return first, stage.get(after=first)
    for i in range(0, 6, 2):
      stage.put(_item(i), delay_us=10_000)
      stage.put(_item(i + 1))
      a, b = jax.jit(step)()
      _assert_item(a, i)
      _assert_item(b, i + 1)


def test_stage_capacity_is_a_hard_limit():
  with rt.StageArea(_spec(), capacity=2) as stage:
    stage.put(_item(0))
    stage.put(_item(1))
    t = time.perf_counter()
    with pytest.raises(rt.StageTimeoutError,
                       match=r"stage \d+ is full: all 2 slots"):
      stage.put(_item(2), timeout_ms=50)
    assert time.perf_counter() - t >= 0.04
    assert (stage.stats().queued, stage.stats().free_slots) == (2, 0)
    _assert_item(jax.jit(lambda: stage.get())(), 0)
    stage.put(_item(2), timeout_ms=50)  # a slot was released
    assert stage.stats().queued == 2


def test_closed_stage_drains_then_fails_and_the_process_lives_on():
  stage = rt.StageArea(_spec(), capacity=2, timeout_ms=1_000)
  step = jax.jit(lambda: stage.get())
  stage.put(_item(4))
  stage.close()
  with pytest.raises(rt.StageClosedError, match="is closed"):
    stage.put(_item(5))
  _assert_item(step(), 4)
  with pytest.raises(HANDLER_ERRORS,
                     match=r"OUT_OF_RANGE: jaxstreams: jaxstreams_stage_get: "
                           rf"stage {stage.id} "
                           r"is closed and has no more items"):
    jax.block_until_ready(step())
  stage.destroy()
  with pytest.raises(HANDLER_ERRORS, match=rf"no stage with id {stage.id}"):
    jax.block_until_ready(step())
  # The process and the runtime carry on.
  np.testing.assert_array_equal(rt.identity(np.arange(3)), np.arange(3))
  with rt.StageArea(_spec(), capacity=1) as again:
    again.put(_item(9))
    _assert_item(jax.jit(lambda: again.get())(), 9)


def test_handler_errors_are_exceptions_with_the_handlers_message():
  x = jnp.ones(3)
  cases = [
      (lambda: _ops.record_p.bind(x, event=10**6, stream=-1),
       r"INVALID_ARGUMENT: jaxstreams: jaxstreams_record: event 1000000 is "
       r"out of range \[0, 1024\)"),
      (lambda: _ops.wait_p.bind(x, event=0, stream=9),
       r"jaxstreams_wait: runtime stream 9 is out of range \[0, 4\)"),
      (lambda: _ops.delay_p.bind(x, microseconds=-5, stream=-1),
       r"jaxstreams_delay: microseconds must be >= 0, got -5"),
  ]
  for program, message in cases:
    with pytest.raises(HANDLER_ERRORS, match=message):
      jax.block_until_ready(jax.jit(program)())

  with rt.StageArea(_spec(), capacity=1, timeout_ms=50) as stage:
    with pytest.raises(HANDLER_ERRORS,
                       match=r"DEADLINE_EXCEEDED: .*no item was put into "
                             rf"stage {stage.id} within 50 ms"):
      jax.block_until_ready(jax.jit(lambda: stage.get())())
    wrong = lambda: _ops.stage_get_p.bind(
        stage=stage.id, timeout_ms=50,
        out_avals=(((3,), np.dtype(np.float32)),))
    with pytest.raises(HANDLER_ERRORS,
                       match=rf"stage {stage.id} holds items of 268 bytes but "
                             r"the program asks for 12 bytes"):
      jax.block_until_ready(jax.jit(wrong)())
    with pytest.raises(ValueError,
                       match=r"item leaf 1 is int32\[3\], the stage holds "
                             r"float32\[64\]"):
      stage.put({"ids": np.zeros(3, np.int32), "x": np.zeros(3, np.int32)})


def _running_ffi_api_version():
  """XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR of the running jaxlib."""
  header = (pathlib.Path(jax.ffi.include_dir())
            / "xla/ffi/api/c_api.h").read_text()
  major, minor = (int(re.search(rf"#define XLA_FFI_API_{part} (\d+)",
                                header).group(1))
                  for part in ("MAJOR", "MINOR"))
  return major * 1000 + minor


def test_library_reports_the_ffi_api_version_it_was_built_against():
  version = _capi.capi("cpu").ffi_api_version()
  # XLA refuses handlers built against newer headers than its own, so a
  # library whose targets registered is at most the running jaxlib's version.
  assert 0 <= version % 1000 and version <= _running_ffi_api_version()


@pytest.mark.skipif(pathlib.Path("/proc/sys/vm/overcommit_memory").exists()
                    and (pathlib.Path("/proc/sys/vm/overcommit_memory")
                         .read_text().strip() == "1"),
                    reason="with overcommit_memory=1 a huge allocation "
                           "succeeds and is touched page by page instead of "
                           "failing")
def test_a_stage_too_large_for_memory_is_an_error_and_the_runtime_lives_on():
  # 2**37 float32 = 512 GiB per slot, 1 TiB in all: within the runtime's size
  # limit, so the allocation itself fails (std::bad_alloc inside the library).
  huge = jax.ShapeDtypeStruct((2**37,), np.float32)
  with pytest.raises(rt.RuntimeOpError, match=r"out of memory"):
    rt.StageArea(huge, capacity=2)
  with rt.StageArea(_spec(), capacity=1) as stage:
    stage.put(_item(3))
    _assert_item(jax.jit(lambda: stage.get())(), 3)


def test_python_side_checks_catch_bad_ids_before_running():
  x = jnp.ones(2)
  with pytest.raises(ValueError, match=r"event must be in \[0, 1024\), got -1"):
    rt.record(x, event=-1)
  with pytest.raises(ValueError, match=r"runtime stream in \[0, 4\), got 4"):
    rt.wait(x, event=0, stream=4)
  with pytest.raises(TypeError, match="at least one array"):
    rt.marker(region=1)
  with pytest.raises(ValueError, match="phase must be BEGIN"):
    rt.marker(x, region=1, phase=5)


def test_timeline_shows_two_overlapping_cpu_workers(tmp_path, event):
  """Two slow regions, one on runtime stream 1 and one on stream 2, each
  bracketed by markers on its own worker: the Chrome trace has one track per
  stream and the two regions overlap in time."""
  e2 = rt.allocate_event()

  def program(x):
    for region, stream in ((1, 1), (2, 2)):
      x = rt.marker(x, region=region, phase=rt.BEGIN, track=stream,
                    stream=stream)
      x = rt.delay(x, microseconds=100_000, stream=stream)
      x = rt.marker(x, region=region, phase=rt.END, track=stream, stream=stream)
    x = rt.record(x, event=event, stream=1)
    x = rt.record(x, event=e2, stream=2)
    x = rt.wait(x, event=event)
    return rt.wait(x, event=e2)

  x = jnp.zeros(2)
  compiled = jax.jit(program).lower(x).compile()
  timeline.reset()
  jax.block_until_ready(compiled(x))
  rt.release_event(e2)
  tl = timeline.read()
  assert tl.dropped == 0
  a, b = sorted(timeline.intervals(tl.markers), key=lambda iv: iv.track)
  assert (a.track, b.track) == (1, 2)
  assert min(a.duration_ns, b.duration_ns) >= 90e6
  assert a.overlaps(b)   # the two 100 ms regions ran side by side

  path = tmp_path / "timeline.json"
  timeline.write_chrome_trace(path, tl,
                              region_names={1: "tower_a", 2: "tower_b"})
  trace = json.loads(path.read_text())
  spans = {ev["name"]: ev for ev in trace["traceEvents"] if ev["ph"] == "X"}
  assert set(spans) == {"tower_a", "tower_b"}
  assert {spans["tower_a"]["tid"], spans["tower_b"]["tid"]} == {1, 2}
  ta, tb = spans["tower_a"], spans["tower_b"]
  assert ta["ts"] < tb["ts"] + tb["dur"] and tb["ts"] < ta["ts"] + ta["dur"]
  rows = {ev["args"]["name"] for ev in trace["traceEvents"]
          if ev.get("name") == "thread_name"}
  assert rows == {"stream 1", "stream 2"}


def test_marker_log_is_bounded():
  timeline.reset(capacity=2)
  x = jnp.zeros(1)
  _run(lambda v: rt.marker(rt.marker(rt.marker(v, region=1), region=2),
                           region=3), x)
  tl = timeline.read()
  assert [m.region for m in tl.markers] == [1, 2]
  assert tl.dropped == 1
  timeline.reset()


def test_shutdown_joins_workers_and_init_starts_again(event):
  rt.shutdown()
  rt.init()
  e = rt.allocate_event()
  x = rt.record(jnp.ones(2), event=e, stream=3)
  np.testing.assert_array_equal(_run(lambda v: rt.wait(v, event=e), x),
                                np.ones(2))
  rt.release_event(e)
