"""jaxstreams.serve with several models, and grouped batches formed by their
callers: every caller gets its own model's jax.jit result or its own error.

Structure and results only, never timings. As in test_serve.py, a *gate*
(a request whose program blocks in a host callback until the test opens it)
keeps one execution in flight, so the requests sent meanwhile leave together
as one batch (a batch leaves as soon as it holds ``groups`` requests; the
wait for more is made long).
"""

import concurrent.futures
import threading

import jax
import jax.numpy as jnp
import pytest

import jaxstreams
from programs import (assert_equal_results, jaxstreams_threads,
                      require_gpu_target, wait_until)

TIMEOUT = 60
GATE = 13             # requests of model "a" of this length wait for the gate

W = jax.random.normal(jax.random.PRNGKey(0), (8, 16), jnp.float32)
V = jax.random.normal(jax.random.PRNGKey(1), (3, 5), jnp.float32)


def check(v):
  if v[0] < 0:
    raise ValueError(f"negative request {float(v[1])}")
  return v


class Models:
  """Model "a" (with the gate and a host check that fails on a negative
  first element) and model "b" (another shape, a pytree out)."""

  def __init__(self):
    self.gate = threading.Event()

  def _wait(self, v):
    assert self.gate.wait(TIMEOUT), "gate never opened"
    return v

  def a(self, x):
    if x.shape == (GATE,):
      return jax.pure_callback(self._wait, jax.ShapeDtypeStruct(x.shape,
                                                                x.dtype), x)
    y = jax.pure_callback(check, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jnp.tanh(y[None, :8] @ W)

  @staticmethod
  def b(x, *, scale=1.0):
    if x.shape[0] == 4:
      raise TypeError("model b refuses 4 rows")       # at trace time
    return {"y": x @ V * scale, "n": x.sum()}

  def serve(self, **kwargs):
    return jaxstreams.serve({"a": self.a, "b": self.b}, mode="grouped",
                            **kwargs)

  def hold(self, server):
    """Send a gate request and wait until its batch was dispatched."""
    self.gate.clear()
    held = server["a"].submit(jnp.zeros(GATE))
    assert wait_until(lambda: not server.queued, TIMEOUT), "never taken"
    return held


def a_input(i, sign=1.0):
  return jnp.concatenate([jnp.array([sign, float(i)]), jnp.full((6,), 0.5)])


def b_input(i, rows=2):
  return jnp.full((rows, 3), float(i), jnp.float32)


def test_a_mixed_model_batch_gives_each_caller_its_own_models_result():
  m = Models()
  with m.serve(groups=4, max_batch_wait_ms=60_000) as server:
    held = m.hold(server)
    futures = [server["a"].submit(a_input(1)),
               server["b"].submit(b_input(2), scale=2.0),
               server["a"].submit(a_input(3)),
               server["b"].submit(b_input(4, rows=3))]
    m.gate.set()
    held.result(TIMEOUT)
    outs = [f.result(TIMEOUT) for f in futures]
    stats = server.stats()
  assert_equal_results(outs[0], jax.jit(m.a)(a_input(1)))
  assert_equal_results(outs[1], jax.jit(Models.b)(b_input(2), scale=2.0))
  assert_equal_results(outs[2], jax.jit(m.a)(a_input(3)))
  assert_equal_results(outs[3], jax.jit(Models.b)(b_input(4, rows=3)))
  assert stats.batch_sizes == {1: 1, 4: 1}        # the gate, then one batch
  assert stats.programs_traced == 2
  assert stats.signatures_traced == 4             # gate, a, b x2, b x3
  assert stats.models == {
      "a": jaxstreams.serving.ModelStats(3, 3, 0, 0),
      "b": jaxstreams.serving.ModelStats(2, 2, 0, 0)}
  assert (stats.requests, stats.completed, stats.direct) == (5, 5, 0)


def test_errors_and_cancellations_of_one_request_leave_the_others_whole():
  m = Models()
  with m.serve(groups=5, max_batch_wait_ms=60_000) as server:
    held = m.hold(server)
    ok_a = server["a"].submit(a_input(1))
    cancelled = server["b"].submit(b_input(9))
    assert cancelled.cancel()                     # before its batch is built
    refused = server["b"].submit(b_input(2, rows=4))   # b's trace error
    failing = server["a"].submit(a_input(3, sign=-1.0))  # fails while it runs
    ok_b = server["b"].submit(b_input(5))
    m.gate.set()
    held.result(TIMEOUT)
    assert_equal_results(ok_a.result(TIMEOUT), jax.jit(m.a)(a_input(1)))
    assert_equal_results(ok_b.result(TIMEOUT), jax.jit(Models.b)(b_input(5)))
    with pytest.raises(TypeError, match="refuses 4 rows"):
      refused.result(TIMEOUT)
    with pytest.raises(Exception, match="negative request 3"):
      failing.result(TIMEOUT)
    assert cancelled.cancelled()
    stats = server.stats()
  # The five left together; the batch was built of the three that could
  # run, and its execution failed (one request's host check), so each ran
  # again alone.
  assert stats.batch_sizes == {1: 1, 3: 1} and stats.fallbacks == 1
  assert stats.models["a"] == jaxstreams.serving.ModelStats(3, 2, 1, 0)
  assert stats.models["b"] == jaxstreams.serving.ModelStats(3, 1, 1, 1)
  assert (stats.requests, stats.completed, stats.failed,
          stats.cancelled) == (6, 3, 2, 1)


def test_callers_form_batches_themselves_without_helper_threads():
  """Synchronous callers dispatch their own batches: while one execution
  runs, the next caller waits for a full batch and dispatches it; no helper
  thread is started."""
  m = Models()
  with m.serve(groups=3, max_batch_wait_ms=60_000) as server:
    pool = concurrent.futures.ThreadPoolExecutor(4)
    m.gate.clear()
    held = pool.submit(server["a"], jnp.zeros(GATE))
    assert wait_until(lambda: server._core.batcher.in_flight == 1, TIMEOUT)
    calls = [pool.submit(server["a"], a_input(1)),
             pool.submit(server["b"], b_input(2)),
             pool.submit(server["a"], a_input(3))]
    # The first of them leads, waits for a full batch and takes it while
    # the gate's execution is in flight (on XLA:CPU its launch may then
    # wait for the gate's program).
    assert wait_until(lambda: server._core.batcher.in_flight == 2, TIMEOUT)
    m.gate.set()
    held.result(TIMEOUT)
    outs = [c.result(TIMEOUT) for c in calls]
    pool.shutdown()
    assert jaxstreams_threads("jaxstreams-serve") == []
    stats = server.stats()
  assert_equal_results(outs, [jax.jit(m.a)(a_input(1)),
                              jax.jit(Models.b)(b_input(2)),
                              jax.jit(m.a)(a_input(3))])
  assert stats.batch_sizes == {1: 1, 3: 1}


def test_warmup_compiles_every_batch_and_nothing_compiles_after():
  m = Models()
  specs = {"a": (jax.ShapeDtypeStruct((8,), jnp.float32),),
           "b": (jax.ShapeDtypeStruct((2, 3), jnp.float32),)}
  with m.serve(groups=3, max_programs=9) as server:
    # Every multiset of the two signatures of 1 to 3 requests: 2 + 3 + 4.
    assert server.warmup(specs) == 9
    assert server["a"].warmup(a_input(0)) == 0      # warmed already
    before = server.stats()
    assert before.requests == 0 and before.batches == 0

    def client(k):
      outs = []
      for i in range(12):
        if (k + i) % 2:
          outs.append((server["a"](a_input(i)), jax.jit(m.a)(a_input(i))))
        else:
          outs.append((server["b"](b_input(i)), jax.jit(Models.b)(b_input(i))))
      return outs

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
      for pairs in pool.map(client, range(6)):
        for got, want in pairs:
          assert_equal_results(got, want)
    after = server.stats()
  assert after.requests == after.completed == 72
  assert after.programs_traced == 9 and after.signatures_traced == 2
  assert after.program_evictions == 0


def test_warmup_beyond_max_programs_is_an_error_and_compiles_nothing():
  m = Models()
  with m.serve(groups=3, max_programs=4) as server:
    with pytest.raises(ValueError, match=r"needs 9 batch programs, more than "
                       r"max_programs=4 keeps: make the server with "
                       r"max_programs >= 9"):
      server.warmup({"a": (a_input(0),), "b": (b_input(0),)})
    assert server.stats().programs_traced == 0


def test_several_models_argument_errors():
  m = Models()
  with pytest.raises(ValueError, match="dict of models is empty"):
    jaxstreams.serve({})
  with pytest.raises(TypeError, match="model names must be strings, got 1"):
    jaxstreams.serve({1: m.a})
  with pytest.raises(TypeError, match="model 'b' must be a callable, got 3"):
    jaxstreams.serve({"a": m.a, "b": 3})
  with m.serve(groups=2) as server:
    assert server.models == ("a", "b")
    with pytest.raises(TypeError, match=r"several models \(a, b\).*"
                       r"server\['a'\]\(\.\.\.\)"):
      server(a_input(0))
    with pytest.raises(TypeError, match=r"server\['a'\]\.submit"):
      server.submit(a_input(0))
    with pytest.raises(KeyError, match=r"serves the models \('a', 'b'\), "
                       r"not 'c'"):
      server["c"]
    with pytest.raises(ValueError, match=r"model names from \('a', 'b'\), "
                       r"got \('a', 'c'\)"):
      server.batch_function(("a", "c"))
    with pytest.raises(TypeError, match="dict of model name -> tuple"):
      server.warmup({"a": a_input(0)})
    assert server["b"].model_name == "b"
    assert "mode=grouped" in repr(server) and "a, b" in repr(server)


def test_a_model_endpoint_keeps_its_server_alive():
  m = Models()
  endpoint = m.serve(groups=2)["b"]
  assert_equal_results(endpoint(b_input(1)), jax.jit(Models.b)(b_input(1)))
  assert_equal_results(endpoint.submit(b_input(2)).result(TIMEOUT),
                       jax.jit(Models.b)(b_input(2)))
  endpoint._server.close()
  with pytest.raises(jaxstreams.ServerClosedError):
    endpoint(b_input(1))


@pytest.mark.parametrize("kind", ["native", "python"])
def test_direct_call_target_and_wait_can_change(kind):
  """The request object runs the target it finds when a request starts,
  and waits for its result only where ``_wait`` says."""
  from jaxstreams.runtime import _loader
  from jaxstreams.serving import _direct, _server
  cls = (_direct.native(_loader.search_dirs()) if kind == "native"
         else _direct.PyDirectCall)
  if cls is None:
    pytest.skip("the C DirectCall is not built")
  waited = []

  def block_tree(out):
    waited.append(out)
    return out

  call = cls(lambda x: {"y": x + 1}, _server._ARRAY_TYPE, block_tree,
             lambda: None, lambda: None)
  assert call._wait is True
  assert call(1) == {"y": 2} and len(waited) == 1
  call._target = lambda x: {"y": x * 10}
  call._wait = False
  assert call(2) == {"y": 20} and len(waited) == 1
  assert (call._running, call._finished, call._failed) == (0, 2, 0)


def test_grouped_batch_of_two_models_is_k_parallel_branches():
  """Compiled for an H100 without one: a batch of k requests of two models
  is k regions, one equation each (nothing copied in or out), and k
  parallel branches of the CUDA graph XLA builds."""
  require_gpu_target("xla_graphs compiles for an H100")
  w1 = jnp.ones((64, 256)) * 0.01
  w2 = jnp.ones((256, 64)) * 0.01

  def tower(x):
    return jnp.tanh(jnp.tanh(x @ w1) @ w2).sum()

  def wide(x):
    return jax.nn.relu(x @ w1).mean(axis=0)

  k = 4
  with jaxstreams.serve({"tower": tower, "wide": wide}, mode="grouped",
                        groups=k) as server:
    models = ("tower", "wide", "tower", "wide")
    fn = server.batch_function(models)
    requests = [((jnp.ones((32, 64)) * (r + 1),), {}) for r in range(k)]
    plan = fn.plan(*requests)
    lowered = fn.trace(*requests).lower(lowering_platforms=("cuda",))
  assert sorted(r.stream for r in plan.regions) == list(range(1, k + 1))
  assert all(len(r.equations) == 1 for r in plan.regions)
  graphs = jaxstreams.xla_graphs(lowered, plan=plan)
  checks = graphs.compare()
  assert len(checks) == k * (k - 1) // 2, graphs.summary()
  assert all(together for _, _, together in checks), graphs.summary()
  assert graphs.parallelism >= 2.0, graphs.summary()


def test_close_lets_a_partial_batch_go_at_once():
  """A caller waiting for its batch to fill (an execution in flight, a long
  max_batch_wait_ms) is dispatched as soon as the server closes."""
  m = Models()
  server = m.serve(groups=4, max_batch_wait_ms=60_000)
  pool = concurrent.futures.ThreadPoolExecutor(3)
  held = m.hold(server)
  waiting = pool.submit(server["b"], b_input(1))
  assert wait_until(lambda: server._core.batcher.leader is not None, TIMEOUT)
  assert server._core.batcher.in_flight == 1        # it waits for more
  closer = pool.submit(server.close, TIMEOUT)
  assert wait_until(lambda: server._core.batcher.in_flight == 2, TIMEOUT)
  m.gate.set()
  held.result(TIMEOUT)
  assert_equal_results(waiting.result(TIMEOUT), jax.jit(Models.b)(b_input(1)))
  assert closer.result(TIMEOUT) is True
  pool.shutdown()


@pytest.mark.parametrize("mode", ["direct", "grouped"])
def test_a_server_of_one_model_is_freed_and_closed_with_its_last_reference(
    mode):
  import weakref
  server = jaxstreams.serve(lambda x: x + 1.0, mode=mode)
  assert_equal_results(server(jnp.ones(2)), jnp.ones(2) + 1.0)
  core = server._core
  ref = weakref.ref(server)
  del server                      # no cycle: gone without a collection
  assert ref() is None and core.closing
