"""jaxstreams.serve: every caller gets jax.jit's result or its own error.

Structure and results only, never timings. Batches are made deterministic
with a *gate*: a request whose program blocks in a host callback until the
test opens the gate keeps one execution in flight, so the requests submitted
meanwhile queue up and leave together as one batch (the dispatcher waits for
more while something runs; max_batch_wait_ms is made long, and a batch
leaves as soon as it holds ``groups`` requests). Every wait has a timeout,
and a fixture checks that no server thread outlives its test.
"""

import concurrent.futures
import gc
import os
import pathlib
import random
import re
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from programs import assert_equal_results, jaxstreams_threads, wait_until

TIMEOUT = 60
ROOT = pathlib.Path(__file__).resolve().parent.parent


def grouped_serve(f, **kwargs):
  """Batching on stream groups, which ``mode="by_platform"`` does not choose
  on XLA:CPU: these tests are about the grouped path's promises."""
  return jaxstreams.serve(f, mode="grouped", **kwargs)


def serve_threads():
  return jaxstreams_threads("jaxstreams-serve")


def wait_for_no_serve_threads(timeout=10.0):
  wait_until(lambda: not serve_threads(), timeout)
  return serve_threads()


# ---------------------------------------------------------------------------
# Programs.

W1 = jax.random.normal(jax.random.PRNGKey(0), (8, 16), jnp.float32)
W2 = jax.random.normal(jax.random.PRNGKey(1), (16, 4), jnp.float32)


def mlp(x):
  return jnp.tanh(x @ W1) @ W2


class Gate:
  """Requests of shape (GATE_LEN,) block in a host callback until opened."""
  LEN = 13

  def __init__(self):
    self.event = threading.Event()

  def wrap(self, f):
    def gated(x, *rest, **kwargs):
      if x.shape == (self.LEN,):
        return jax.pure_callback(self._wait, jax.ShapeDtypeStruct(x.shape,
                                                                  x.dtype), x)
      return f(x, *rest, **kwargs)
    gated.__name__ = f.__name__
    return gated

  def _wait(self, v):
    assert self.event.wait(TIMEOUT), "gate never opened"
    return v

  def hold(self, server):
    """Submit a gate request (it keeps one execution in flight) and wait until
    the dispatcher has taken it."""
    self.event.clear()
    fut = server.submit(jnp.zeros(self.LEN))
    assert wait_until(lambda: not server.queued, TIMEOUT), "never taken"
    return fut

  def open(self):
    self.event.set()


def results(futures):
  return [f.result(TIMEOUT) for f in futures]


# ---------------------------------------------------------------------------
# Results and structure.

def test_results_bitwise_equal_to_jax_jit_with_pytrees_kwargs_scalars():
  def f(tree, scale, *, shift):
    return {"a": jnp.sin(tree["x"]) * scale + shift,
            "b": [tree["y"].sum(), None]}

  tree = {"x": jnp.arange(6.0).reshape(2, 3), "y": np.ones(4, np.int32)}
  expected = jax.jit(f)(tree, 0.5, shift=2)
  with grouped_serve(f, groups=2) as server:
    assert_equal_results(server(tree, 0.5, shift=2), expected)
    assert_equal_results(server.submit(tree, 0.5, shift=2).result(TIMEOUT),
                         expected)


def test_many_threads_mixed_shapes_bitwise_and_one_trace_per_signature():
  traces = []

  def f(x):
    traces.append(x.shape)
    return mlp(x) * 2.0 + x.sum()

  shapes = [(1, 8), (2, 8), (5, 8)]
  inputs = [jax.random.normal(jax.random.PRNGKey(i), shapes[i % 3])
            for i in range(24)]
  expected = [jax.jit(f)(x) for x in inputs]
  traces.clear()
  with grouped_serve(f, groups=4, max_batch_wait_ms=2) as server:
    def client(indices):
      return [(i, server(inputs[i])) for i in indices]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      outs = [pool.submit(client, range(t, 24, 8)) for t in range(8)]
      got = dict(kv for o in outs for kv in o.result(TIMEOUT))
    stats = server.stats()
  for i, x in enumerate(inputs):
    assert_equal_results(got[i], expected[i])
  assert sorted(traces) == sorted(shapes)          # f traced once per shape
  assert stats.signatures_traced == 3
  assert stats.requests == stats.completed == 24 and stats.failed == 0
  assert sum(k * n for k, n in stats.batch_sizes.items()) == 24
  assert max(stats.batch_sizes) <= 4
  # One trace per combination of signatures: nothing was traced twice.
  assert stats.programs_traced == stats.programs_cached
  assert stats.program_evictions == 0


def test_requests_that_arrive_together_share_one_execution():
  gate = Gate()
  f = gate.wrap(mlp)
  a, b = jnp.ones((1, 8)), jnp.ones((2, 8))
  with grouped_serve(f, groups=3, max_batch_wait_ms=60_000) as server:
    held = gate.hold(server)
    first = [server.submit(x) for x in (a, b, a)]
    batch_after = [server.submit(x) for x in (a, b, a)]  # same combination
    gate.open()
    held.result(TIMEOUT)
    results(first + batch_after)
    held = gate.hold(server)
    third = [server.submit(x) for x in (b, a, a)]        # another order
    gate.open()
    held.result(TIMEOUT)
    outs = results(third)
    held = gate.hold(server)
    fourth = [server.submit(x) for x in (b, b, a)]       # a new combination
    gate.open()
    held.result(TIMEOUT)
    outs_fourth = results(fourth)
    stats = server.stats()
  assert_equal_results(outs, [jax.jit(mlp)(x) for x in (b, a, a)])
  assert_equal_results(outs_fourth, [jax.jit(mlp)(x) for x in (b, b, a)])
  assert stats.batch_sizes == {1: 3, 3: 4}
  # The gate alone; (a, b, a) for two batches and, put in the same order,
  # (b, a, a) too; then (b, b, a).
  assert stats.programs_traced == 3
  assert stats.signatures_traced == 3


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_batch_of_k_lowers_to_k_stream_annotations(k, stream_calls):
  server = grouped_serve(mlp, groups=4)
  fn = server.batch_function()
  requests = [((jnp.ones((1 + r, 8)),), {}) for r in range(k)]
  text = fn.trace(*requests).lower(lowering_platforms=("cuda",)).as_text()
  annotations = re.findall(r'_xla_stream_annotation = "(\d+)"', text)
  assert sorted(set(annotations)) == [str(s) for s in range(1, k + 1)]
  plan = fn.plan(*requests)
  assert sorted(r.stream for r in plan.regions) == list(range(1, k + 1))
  assert not server.closed   # never used: no threads started
  server.close()


def test_grouped_requests_run_the_default_gpu_way():
  """Each request of a batch is a region: by default, at top level, XLA's
  CONCURRENT graphs run them side by side (jaxstreams.lower.gpu)."""
  with grouped_serve(mlp, groups=2) as server:
    fn = server.batch_function()
    requests = [((jnp.ones((1, 8)),), {}), ((jnp.ones((2, 8)),), {})]
    plan = fn.plan(*requests)
    assert plan.gpu_lowering == "concurrent"
    lowered = fn.trace(*requests).lower(lowering_platforms=("cuda",))
    assert dict(lowered._lowering._compiler_options_kvs) == {
        "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def test_stream_blocks_inside_f_are_flattened_into_the_group(stream_calls):
  def f(x, w):
    with jaxstreams.stream(5):            # beyond groups: flattened, unchecked
      a = jnp.tanh(x @ w)
    with jaxstreams.stream(1):
      b = jnp.cos(x).sum()
    return a * b

  x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
  requests = [((x, w), {}), ((x * 2, w), {})]
  with grouped_serve(f, groups=2) as server:
    plan = server.batch_function().plan(*requests)
    assert [(r.stream, len(r.equations)) for r in plan.regions] == [(1, 1),
                                                                    (2, 1)]
    text = server.batch_function().trace(*requests).lower(
        lowering_platforms=("cuda",)).as_text()
    assert sorted(set(re.findall(r'_xla_stream_annotation = "(\d+)"',
                                 text))) == ["1", "2"]
    assert_equal_results(results([server.submit(x, w),
                                  server.submit(x * 2, w)]),
                         [jax.jit(f)(x, w), jax.jit(f)(x * 2, w)])
    # A jaxstreams.jit function is served as its Python function.
    with grouped_serve(jaxstreams.jit(f, streams=6), groups=2) as jitted:
      assert_equal_results(jitted(x, w), jax.jit(f)(x, w))


# ---------------------------------------------------------------------------
# Failures reach their own caller only.

def test_injected_failures_many_threads_each_caller_gets_its_own():
  def check(v):
    if v[0] < 0:
      raise ValueError(f"request {int(v[1])} is negative")
    return v

  def f(x):
    if x.shape == (3,):
      raise ValueError("f refuses shape (3,)")    # at trace time
    y = jax.pure_callback(check, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jnp.sin(y) * 2.0 + x                   # fails at run time if x<0

  rng = random.Random(0)
  requests = []
  for i in range(48):
    n = rng.choice([2, 3, 4])
    sign = -1.0 if rng.random() < 0.25 else 1.0
    requests.append(jnp.array([sign] + [float(i)] * (n - 1)))
  good = {i: jax.jit(f)(x) for i, x in enumerate(requests)
          if x.shape != (3,) and x[0] > 0}

  with grouped_serve(f, groups=4, max_batch_wait_ms=5) as server:
    def client(i):
      try:
        return i, server(requests[i]), None
      except Exception as e:  # noqa: BLE001
        return i, None, e
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
      outcomes = list(pool.map(client, range(48), timeout=TIMEOUT))
    stats = server.stats()

  for i, out, error in outcomes:
    x = requests[i]
    if x.shape == (3,):
      assert isinstance(error, ValueError) and "refuses" in str(error)
    elif x[0] < 0:
      assert error is not None and f"request {i} is negative" in str(error)
    else:
      assert error is None, (i, error)
      assert_equal_results(out, good[i])
  assert stats.completed == len(good)
  assert stats.failed == 48 - len(good)


def test_failed_batch_falls_back_to_one_by_one():
  gate = Gate()

  def check(v):
    if v[0] < 0:
      raise ValueError("negative")
    return v

  def f(x):
    return jax.pure_callback(check, jax.ShapeDtypeStruct(x.shape, x.dtype),
                             x) + 1.0

  ok, bad = jnp.array([1.0, 2.0]), jnp.array([-1.0, 2.0])
  with grouped_serve(gate.wrap(f), groups=3,
                        max_batch_wait_ms=60_000) as server:
    held = gate.hold(server)
    futures = [server.submit(x) for x in (ok, bad, ok)]
    gate.open()
    held.result(TIMEOUT)
    assert_equal_results(futures[0].result(TIMEOUT), jax.jit(f)(ok))
    assert_equal_results(futures[2].result(TIMEOUT), jax.jit(f)(ok))
    with pytest.raises(Exception, match="negative"):
      futures[1].result(TIMEOUT)
    assert server.stats().fallbacks == 1


def test_trace_error_leaves_the_batch_before_it_is_built():
  gate = Gate()
  calls = []

  def f(x):
    calls.append(x.shape)
    if x.shape == (3,):
      raise TypeError("no threes")
    return x * 2

  with grouped_serve(gate.wrap(f), groups=3,
                        max_batch_wait_ms=60_000) as server:
    held = gate.hold(server)
    futures = [server.submit(jnp.ones(n)) for n in (2, 3, 4)]
    gate.open()
    held.result(TIMEOUT)
    with pytest.raises(TypeError, match="no threes"):
      futures[1].result(TIMEOUT)
    assert_equal_results(results([futures[0], futures[2]]),
                         [jnp.ones(2) * 2, jnp.ones(4) * 2])
    # A bad argument is the caller's error too.
    with pytest.raises(TypeError):
      server("not an array")
    stats = server.stats()
  assert stats.fallbacks == 0 and stats.batch_sizes == {1: 1, 2: 1}


# ---------------------------------------------------------------------------
# Back-pressure and closing.

def test_full_queue_raises_or_blocks_as_chosen():
  gate = Gate()
  f = gate.wrap(mlp)
  x = jnp.ones((1, 8))
  with grouped_serve(f, groups=1, queue_size=2, block=False,
                        max_batch_wait_ms=60_000) as server:
    held = gate.hold(server)
    queued = []
    # queue_size bounds a model's requests from admission to result: the
    # gate request holds one place, so one more fits.
    with pytest.raises(jaxstreams.QueueFullError,
                       match="at its limit of 2 requests of this model queued "
                             "or running") as full:
      for _ in range(10):
        queued.append(server.submit(x))
    assert "block=False" in str(full.value)
    assert len(queued) == 1
    gate.open()
    held.result(TIMEOUT)
    results(queued)

  with grouped_serve(f, groups=1, queue_size=1, block=0.05,
                        max_batch_wait_ms=60_000) as server:
    held = gate.hold(server)
    with pytest.raises(jaxstreams.QueueFullError,
                       match="stayed at its limit of 1 request.*block=0.05"):
      for _ in range(10):
        queued.append(server.submit(x))
    gate.open()
    held.result(TIMEOUT)

  with grouped_serve(f, groups=1, queue_size=1, block=True,
                        max_batch_wait_ms=60_000) as server:
    held = gate.hold(server)
    submitted = []
    def producer():
      for _ in range(4):
        submitted.append(server.submit(x))
    thread = threading.Thread(target=producer)
    thread.start()
    time.sleep(0.05)
    assert thread.is_alive()         # blocked on the full queue, not failed
    gate.open()
    thread.join(TIMEOUT)
    assert not thread.is_alive() and len(submitted) == 4
    assert_equal_results(results(submitted), [jax.jit(mlp)(x)] * 4)
    held.result(TIMEOUT)


def test_close_while_busy_finishes_queued_and_refuses_new():
  gate = Gate()
  f = gate.wrap(lambda x: x * 3.0 + 1.0)
  stop = threading.Event()
  with grouped_serve(f, groups=4, queue_size=8) as server:
    held = gate.hold(server)
    accepted, refused = [], []

    def client(t):
      i = 0
      while not stop.is_set():
        x = jnp.full((2,), float(t * 1000 + i))
        try:
          accepted.append((x, server.submit(x)))
        except jaxstreams.ServerClosedError as e:
          refused.append(e)
          return
        i += 1

    clients = [threading.Thread(target=client, args=(t,)) for t in range(6)]
    for c in clients:
      c.start()
    time.sleep(0.05)      # the queue fills; producers block on it
    closer = threading.Thread(target=server.close)
    closer.start()
    time.sleep(0.05)
    gate.open()
    closer.join(TIMEOUT)
    stop.set()
    for c in clients:
      c.join(TIMEOUT)
    assert not any(c.is_alive() for c in clients) and not closer.is_alive()
    assert server.closed
    held.result(TIMEOUT)
    for x, fut in accepted:           # every accepted request was finished
      assert_equal_results(fut.result(0), x * 3.0 + 1.0)
    assert len(refused) == 6          # every client then saw the close
    assert "closed" in str(refused[0])
    with pytest.raises(jaxstreams.ServerClosedError):
      server(jnp.ones(2))
  assert serve_threads() == []


def test_threads_end_on_close_exit_and_garbage_collection():
  server = grouped_serve(mlp, groups=2)
  assert serve_threads() == []                   # started lazily
  server(jnp.ones((1, 8)))                       # alone: runs in this thread
  assert serve_threads() == []
  server.submit(jnp.ones((1, 8))).result(TIMEOUT)
  assert len(serve_threads()) == 2
  assert server.close(timeout=TIMEOUT)
  assert serve_threads() == []
  server.close()                                 # idempotent

  with grouped_serve(mlp) as server:
    server.submit(jnp.ones((1, 8))).result(TIMEOUT)
  assert serve_threads() == []

  server = grouped_serve(mlp)
  server.submit(jnp.ones((1, 8))).result(TIMEOUT)
  del server
  gc.collect()
  assert wait_for_no_serve_threads() == []


def test_program_cache_is_bounded():
  traces = []

  def f(x):
    traces.append(x.shape)
    return x + 1

  with grouped_serve(f, groups=1, max_programs=2) as server:
    for n in [1, 2, 3, 1, 2, 3]:      # submitted: each through the batch path
      assert_equal_results(server.submit(jnp.ones(n)).result(TIMEOUT),
                           jnp.ones(n) + 1)
    stats = server.stats()
  assert stats.programs_cached == 2
  assert stats.program_evictions == 4
  assert stats.programs_traced == 6


def test_argument_errors():
  with pytest.raises(ValueError, match="groups"):
    jaxstreams.serve(mlp, groups=0)
  with pytest.raises(TypeError, match="groups"):
    jaxstreams.serve(mlp, groups=2.0)
  with pytest.raises(ValueError, match="max_batch_wait_ms"):
    jaxstreams.serve(mlp, max_batch_wait_ms=-1)
  with pytest.raises(TypeError, match="block"):
    jaxstreams.serve(mlp, block="yes")
  with pytest.raises(ValueError, match="queue_size"):
    jaxstreams.serve(mlp, queue_size=0)
  with pytest.raises(TypeError, match="callable"):
    jaxstreams.serve(3)
  with pytest.raises(ValueError, match="mode must be one of"):
    jaxstreams.serve(mlp, mode="streams")
  with pytest.raises(ValueError, match=r"mode must be one of \('by_platform', "
                     r"'direct', 'grouped'\), got 'auto'"):
    jaxstreams.serve(mlp, mode="auto")
  with pytest.raises(TypeError, match="static_argnums"):
    jaxstreams.serve(jaxstreams.jit(lambda x, n: x * n, streams=2,
                                    static_argnums=1))
  decorated = jaxstreams.serve(groups=2)(mlp)
  assert isinstance(decorated, jaxstreams.Server) and decorated.groups == 2
  decorated.close()


# ---------------------------------------------------------------------------
# Direct mode: where stream groups cannot pay, a request runs as a plain
# thread would run it. Its request object has two implementations, C and
# Python (serving/_direct.py): the tests of direct mode run with each.

def _native_direct_call():
  from jaxstreams.runtime import _loader
  from jaxstreams.serving import _direct
  return _direct.native(_loader.search_dirs())


@pytest.fixture(params=["native", "python"])
def direct_call(request, monkeypatch):
  """Servers made in the test use this implementation of DirectCall."""
  from jaxstreams.serving import _direct, _server
  if request.param == "native":
    kind = _native_direct_call()
    if kind is None:
      pytest.skip("the C DirectCall is not built (test_native_direct_call_"
                  "is_built_with_the_runtime says whether it should be)")
  else:
    kind = _direct.PyDirectCall
  monkeypatch.setattr(_server, "_direct_call_type", lambda: kind)
  return kind


def test_native_direct_call_is_built_with_the_runtime():
  """Wherever the native CPU runtime was built, serve's C request was built
  beside it (a build without Python.h is the only way to lack it)."""
  import sysconfig
  from jaxstreams.runtime import _loader
  from jaxstreams.serving import _server
  dirs = _loader.search_dirs()
  if not any((d / "libjaxstreams_cpu.so").is_file() for d in dirs):
    pytest.skip(f"no native runtime build in {dirs}")
  if not (pathlib.Path(sysconfig.get_paths()["include"])
          / "Python.h").is_file():
    pytest.skip("this Python has no Python.h: a build here cannot make the "
                "module, and serve runs its Python implementation")
  native = _native_direct_call()
  assert native is not None, f"_serve_direct.abi3.so missing from {dirs}"
  assert _server._direct_call_type() is native
  assert native.__module__ == "jaxstreams.serving._serve_direct"


@pytest.mark.parametrize("kind", ["native", "python"])
def test_direct_call_counts_and_admits(kind):
  """The request object alone: admission by admit_limit, the slow way when
  it is reached, exact counts from many threads, errors counted and raised,
  wake() called while must_wake is set, a pytree output waited for."""
  from jaxstreams.serving import _direct, _server
  cls = _native_direct_call() if kind == "native" else _direct.PyDirectCall
  if cls is None:
    pytest.skip("the C DirectCall is not built")
  calls = {"slow": 0, "wake": 0}

  def fn(x):
    if x is None:
      raise ValueError("no None")
    return {"y": x * 2}

  def slow():
    calls["slow"] += 1
    if not direct._take(2):
      raise RuntimeError("full")

  def wake():
    calls["wake"] += 1

  jitted = jax.jit(lambda x: fn(x))
  direct = cls(jitted, _server._ARRAY_TYPE, jax.block_until_ready, slow, wake)
  assert (direct._running, direct._finished, direct._failed) == (0, 0, 0)
  np.testing.assert_array_equal(direct(jnp.ones(2))["y"], [2.0, 2.0])
  direct._admit_limit = 0                     # every request goes the slow way
  np.testing.assert_array_equal(direct(x=jnp.ones(2))["y"], [2.0, 2.0])
  assert calls["slow"] == 1
  assert direct._take(1) and not direct._take(1)   # one token out, limit 1
  direct._release()
  direct._must_wake = True
  with pytest.raises(ValueError, match="no None"):
    direct(None)                             # raised while jax.jit traces
  assert calls["wake"] == 1
  assert (direct._running, direct._finished, direct._failed) == (0, 3, 1)
  assert direct._take(5) and direct._take(5)     # two running elsewhere
  with pytest.raises(RuntimeError, match="full"):
    direct(jnp.ones(2))                      # refused: no token, no count
  assert (direct._running, direct._finished, direct._failed) == (2, 3, 1)
  assert calls["wake"] == 1                  # a refusal ends nothing

  plain = cls(jax.jit(lambda x: x + 1.0), _server._ARRAY_TYPE,
              jax.block_until_ready, slow, wake)
  errors = []

  def client():
    for _ in range(200):
      try:
        plain(jnp.ones(()))
      except Exception as e:  # noqa: BLE001
        errors.append(e)

  threads = [threading.Thread(target=client) for _ in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(TIMEOUT)
  assert not errors
  assert (plain._running, plain._finished, plain._failed) == (0, 1600, 0)


@pytest.mark.cpu_backend
def test_by_platform_on_cpu_runs_each_request_in_its_callers_thread(
    direct_call):
  traced_in = []

  def f(x):
    traced_in.append(threading.current_thread())
    return x * 2

  with jaxstreams.serve(f, groups=4) as server:
    assert server.mode == "direct" and "mode=direct" in repr(server)
    assert_equal_results(server(jnp.ones(3)), jax.jit(f)(jnp.ones(3)))
    assert_equal_results(server.submit(jnp.ones(3)).result(TIMEOUT),
                         jax.jit(f)(jnp.ones(3)))
    assert serve_threads() == []                 # no worker threads at all
    stats = server.stats()
  assert traced_in and set(traced_in) == {threading.current_thread()}
  assert "one stream" in stats.mode_reason
  assert (stats.requests, stats.completed, stats.direct) == (2, 2, 2)
  assert stats.batches == 0 and stats.programs_traced == 0


def test_direct_mode_keeps_serves_promises(direct_call):
  def f(x, *, shift):
    if x.shape == (7,):
      raise ValueError("no sevens")
    return {"y": jnp.sin(x) + shift}

  with jaxstreams.serve(f, mode="direct", groups=4) as server:
    results = {}

    def client(n):
      results[n] = server(jnp.arange(float(n)), shift=n)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(1, 7)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(TIMEOUT)
    for n in range(1, 7):
      assert_equal_results(results[n],
                           jax.jit(f)(jnp.arange(float(n)), shift=n))
    with pytest.raises(ValueError, match="no sevens"):
      server(jnp.ones(7), shift=1)
    future = server.submit(jnp.ones(7), shift=1)
    assert isinstance(future.exception(TIMEOUT), ValueError)
    stats = server.stats()
  assert (stats.requests, stats.completed, stats.failed) == (8, 6, 2)
  with pytest.raises(jaxstreams.ServerClosedError):
    server(jnp.ones(2), shift=1)


def test_direct_mode_back_pressure_and_close_drains(direct_call):
  gate = threading.Event()
  entered = threading.Event()

  def wait(v):
    entered.set()
    assert gate.wait(TIMEOUT)
    return v

  def f(x):
    return jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

  server = jaxstreams.serve(f, mode="direct", queue_size=1, block=False)
  running = concurrent.futures.ThreadPoolExecutor(2)
  first = running.submit(server, jnp.ones(2))
  assert entered.wait(TIMEOUT)
  # One may run at once; the message says they run, not that they wait.
  with pytest.raises(jaxstreams.QueueFullError,
                     match="limit of 1 request running at once") as full:
    server(jnp.ones(2))
  assert "waiting" not in str(full.value)
  closer = running.submit(server.close, TIMEOUT)
  wait_until(lambda: server.closed, TIMEOUT)
  assert not first.done() and not closer.done()  # close waits for it
  gate.set()
  np.testing.assert_array_equal(first.result(TIMEOUT), jnp.ones(2))
  assert closer.result(TIMEOUT) is True          # drained, then closed
  running.shutdown()
  with pytest.raises(jaxstreams.ServerClosedError):
    server.submit(jnp.ones(2))


def test_direct_mode_counts_exactly_under_many_threads(direct_call):
  """The direct path takes no lock for a request admitted at once: its
  counts must still be exact with many callers at once."""
  def f(x):
    if x.shape == (3,):
      raise ValueError("no threes")
    return x + 1.0

  with jaxstreams.serve(f, mode="direct") as server:
    errors = []

    def client(k):
      for i in range(40):
        shape = (3,) if (k + i) % 10 == 0 else (2,)
        try:
          np.testing.assert_array_equal(server(jnp.ones(shape)), [2.0, 2.0])
        except ValueError as e:
          errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(TIMEOUT)
    stats = server.stats()
  assert len(errors) == 64
  assert (stats.requests, stats.completed, stats.failed) == (640, 576, 64)
  assert stats.direct == 640


def test_direct_mode_waits_for_room_and_never_runs_more_than_queue_size(
    direct_call):
  lock = threading.Lock()
  now, most = [0], [0]

  def inside(v):
    with lock:
      now[0] += 1
      most[0] = max(most[0], now[0])
    time.sleep(0.002)
    with lock:
      now[0] -= 1
    return v

  def f(x):
    return jax.pure_callback(inside, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

  with jaxstreams.serve(f, mode="direct", queue_size=2, block=True) as server:
    def client(k):
      for i in range(10):
        np.testing.assert_array_equal(server(jnp.full(2, k + i)), k + i)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(TIMEOUT)
    stats = server.stats()
  assert not any(t.is_alive() for t in threads)
  assert 1 <= most[0] <= 2
  assert (stats.requests, stats.completed, stats.failed) == (80, 80, 0)


def test_direct_mode_wait_for_room_times_out_or_ends_with_close(direct_call):
  gate, entered = threading.Event(), threading.Event()

  def hold(v):
    entered.set()
    assert gate.wait(TIMEOUT)
    return v

  def f(x):
    return jax.pure_callback(hold, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

  server = jaxstreams.serve(f, mode="direct", queue_size=1, block=0.05)
  pool = concurrent.futures.ThreadPoolExecutor(3)
  first = pool.submit(server, jnp.ones(2))
  assert entered.wait(TIMEOUT)
  with pytest.raises(jaxstreams.QueueFullError,
                     match="stayed at its limit of 1 request running at "
                           "once.*for block=0.05 seconds"):
    server(jnp.ones(2))
  server._core.admission.block = True   # now wait as long as it takes ...
  waiting = pool.submit(server, jnp.ones(2))
  assert wait_until(lambda: server._core.admission.space_waiters == 1, TIMEOUT)
  closer = pool.submit(server.close, TIMEOUT)
  # ... until the close: the waiter is refused, the running one finishes.
  with pytest.raises(jaxstreams.ServerClosedError):
    waiting.result(TIMEOUT)
  gate.set()
  np.testing.assert_array_equal(first.result(TIMEOUT), jnp.ones(2))
  assert closer.result(TIMEOUT) is True
  pool.shutdown()
  stats = server.stats()
  assert (stats.requests, stats.completed, stats.failed) == (1, 1, 0)


# ---------------------------------------------------------------------------
# The by-platform choice on a GPU, with a fake platform and a fake clock: the
# trial runs both ways for real (on CPU), and the clock decides.

@pytest.fixture
def fake_gpu(monkeypatch):
  """``mode="by_platform"`` sees a GPU; timing is on (conftest turns it off
  for every test) and the trial's clock is ``clock.seconds[way]``, counting
  the runs of each way it timed."""
  from jaxstreams.serving import _choice

  class Clock:
    seconds = {"direct": 0.02, "grouped": 0.01}
    runs = {"direct": 0, "grouped": 0}

    def __call__(self, way, run):
      run()
      self.runs[way] += 1
      return self.seconds[way]

  clock = Clock()
  monkeypatch.setattr(_choice, "platform", lambda: "gpu")
  monkeypatch.setattr(_choice, "time_way", clock)
  jaxstreams.config.update("jaxstreams_autotune", True)
  yield clock
  jaxstreams.config.reset("jaxstreams_autotune")
  jaxstreams.config.reset("jaxstreams_autotune_cache")


def test_by_platform_on_a_gpu_keeps_grouped_where_it_measured_faster(fake_gpu):
  x = jnp.ones((1, 8))
  with jaxstreams.serve(mlp, groups=2) as server:
    assert server.mode == "direct"
    assert "deciding" in server.stats().mode_reason
    assert_equal_results(server(x), jax.jit(mlp)(x))   # runs, then measures
    assert server.mode == "grouped"
    reason = server.stats().mode_reason
    assert "chose 'grouped': 2.00x of 'direct'" in reason, reason
    assert "2 client threads" in reason and "mode=grouped" in repr(server)
    assert fake_gpu.runs["direct"] >= 5 and fake_gpu.runs["grouped"] >= 5
    traced = server.stats().programs_traced
    assert traced == 2                 # batches of 1 and 2, before timing
    for v in (x, x * 2, x * 3):
      assert_equal_results(server(v), jax.jit(mlp)(v))
    stats = server.stats()
  # The trial's own requests are not the server's.
  assert (stats.requests, stats.completed, stats.direct) == (4, 4, 1)
  assert sum(k * n for k, n in stats.batch_sizes.items()) == 3
  assert stats.programs_traced == traced        # nothing new to compile


def test_by_platform_on_a_gpu_keeps_direct_unless_grouped_wins_clearly(
    fake_gpu):
  fake_gpu.seconds = {"direct": 0.02, "grouped": 0.0199}   # 0.5%: noise
  x = jnp.ones((1, 8))
  with jaxstreams.serve(mlp, groups=2) as server:
    server(x)
    assert server.mode == "direct"
    reason = server.stats().mode_reason
    assert "kept 'direct'" in reason and "gained 0.5%" in reason, reason
    server(x)
    stats = server.stats()
  assert stats.direct == 2 and stats.batches == 0


def test_by_platform_on_a_gpu_decides_at_warmup_and_from_the_cache(
    fake_gpu, tmp_path):
  jaxstreams.config.update("jaxstreams_autotune_cache",
                           str(tmp_path / "autotune.json"))
  spec = jax.ShapeDtypeStruct((1, 8), jnp.float32)
  with jaxstreams.serve(mlp, groups=3) as server:
    assert server.warmup(spec) == 3         # batches of 1, 2 and 3
    assert server.mode == "grouped" and server.stats().requests == 0
  timed = dict(fake_gpu.runs)
  with jaxstreams.serve(mlp, groups=3) as again:
    again.warmup(spec)
    assert again.mode == "grouped"
    assert "from the cache" in again.stats().mode_reason
  assert fake_gpu.runs == timed             # nothing timed the second time
  with jaxstreams.serve(mlp, groups=2) as other:   # another key: measured
    other.warmup(spec)
  assert fake_gpu.runs != timed


def test_by_platform_does_not_measure_where_grouping_cannot_pay(
    fake_gpu, monkeypatch):
  from jaxstreams.serving import _choice
  x = jnp.ones((1, 8))
  with jaxstreams.serve(mlp, groups=1) as server:
    server(x)
    assert server.mode == "direct"
    assert "groups=1" in server.stats().mode_reason
  jaxstreams.config.update("jaxstreams_autotune", False)
  with jaxstreams.serve(mlp, groups=2) as server:
    server(x)
    assert server.mode == "direct"
    assert "jaxstreams_autotune is off" in server.stats().mode_reason
  monkeypatch.setattr(_choice, "platform", lambda: "tpu")
  jaxstreams.config.update("jaxstreams_autotune", True)
  with jaxstreams.serve(mlp, groups=2) as server:
    server(x)
    assert server.mode == "direct" and "tpu" in server.stats().mode_reason
  assert fake_gpu.runs == {"direct": 0, "grouped": 0}
  with jaxstreams.serve(mlp, groups=2, mode="grouped") as server:
    assert server.mode == "grouped"
    assert server.stats().mode_reason == "mode='grouped' was asked for"


def test_by_platform_keeps_direct_where_measuring_fails(fake_gpu):
  """Batches of 1 and 2 need two programs, and max_programs=1 keeps one:
  the trial cannot run, the request still gets its result, and the server
  says why it stays direct."""
  x = jnp.ones((1, 8))
  with jaxstreams.serve(mlp, groups=2, max_programs=1) as server:
    assert_equal_results(server(x), jax.jit(mlp)(x))
    assert server.mode == "direct"
    reason = server.stats().mode_reason
    assert reason.startswith("kept 'direct': measuring grouped failed "
                             "(ValueError: warming up 1 request signature"), \
        reason
    assert_equal_results(server(x * 2), jax.jit(mlp)(x * 2))
  assert fake_gpu.runs == {"direct": 0, "grouped": 0}


def test_by_platform_trial_after_a_failed_first_request(fake_gpu):
  """A first request that fails is its caller's error; the choice waits for
  a request that runs."""
  def f(x):
    if x.shape == (3,):
      raise ValueError("no threes")
    return x * 2.0

  with jaxstreams.serve(f, groups=2) as server:
    with pytest.raises(ValueError, match="no threes"):
      server(jnp.ones(3))
    assert server.mode == "direct" and "deciding" in server.stats().mode_reason
    assert_equal_results(server(jnp.ones(2)), jnp.ones(2) * 2.0)
    assert server.mode == "grouped"
    stats = server.stats()
  assert (stats.requests, stats.completed, stats.failed) == (2, 1, 1)


# ---------------------------------------------------------------------------
# The example.

@pytest.mark.once
def test_inference_example_runs():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  proc = subprocess.run(
      [sys.executable, str(ROOT / "examples" / "multistream_inference.py"),
       "--requests", "48", "--threads", "4", "--groups", "4",
       "--batch_size", "2"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  out = proc.stdout
  assert re.search(r"^groups=1: \d+ requests", out, re.M), out
  assert re.search(r"^groups=4: \d+ requests", out, re.M), out
  assert re.search(r"^two models, groups=4: 48 requests.*mode grouped.*per "
                   r"model classifier \d+, second \d+$", out, re.M), out
  assert "results equal to jax.jit: yes" in out, out
