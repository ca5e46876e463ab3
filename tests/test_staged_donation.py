"""jaxstreams.staged: what is staged and what is given up.

* Constant-only equations (``jnp.arange``, ``jnp.zeros``, arithmetic on
  closed-over constants: data-only, but reading no leaf of the data) are not
  staged values: each part that reads one computes it, the consumer when
  only the consumer does. Checked on the plan (primitive names, the
  ``constant`` flag, the values carried between parts) for ``smart=True``
  and for constants feeding ``stage()`` calls.
* Fused mode donates the staged values to the program that reads them for
  the last time: after the call their buffers are deleted, while the
  caller's batch arrays (already on the device, so placing them returns
  the very same arrays) and values a later part still reads are not.
* Donation and the error path: a failed program is run again part by part
  to find whose error it was, so parts that may raise do not donate, and an
  input that is gone all the same gives the original error, never a
  deleted-buffer one.

Outputs are bitwise those of the step as one jitted program; structure and
values only, never timings.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from jaxstreams.staging import staged_plan
from programs import assert_equal_results, wait_until

analysis_module = importlib.import_module("jaxstreams.partition.stages")

B = 8
CONST = np.linspace(0.0, 1.0, 6, dtype=np.float32)   # closed over by the step


def _params():
  rng = np.random.default_rng(1)
  return {"w": jnp.asarray(rng.standard_normal((4, 6)), jnp.float32),
          "v": jnp.asarray(rng.standard_normal((6,)), jnp.float32)}


def _batches(n, seed=0):
  """Batches as jax arrays on the device (batch i has ``ids[0] == i``)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    ids = rng.integers(0, 1000, size=(B,), dtype=np.int32)
    ids[0] = i
    out.append({"ids": jnp.asarray(ids),
                "x": jnp.asarray(rng.standard_normal((B, 4)), jnp.float32)})
  return out


def _leaves(tree):
  return jax.tree_util.tree_leaves(tree)


def _run_all(runner, *args):
  outs = []
  while True:
    try:
      outs.append(runner(*args))
    except StopIteration:
      return outs


def _primitives(spec):
  return [(e.primitive, e.constant) for e in spec.equations]


# ---------------------------------------------------------------------------
# Constant-only equations.

def const_step(params, batch):
  pos = jnp.arange(B, dtype=jnp.float32)          # constant: read by both
  feat = batch["x"] * 2.0 + pos[:, None]          # data: staged
  scale = jnp.cos(pos) + 1.5                      # constant: consumer only
  bias = jnp.asarray(CONST) * 2.0                 # closed-over: consumer only
  h = jnp.tanh(feat @ params["w"] + bias)
  return jnp.sum(h * scale[:, None]), h


def test_smart_leaves_constant_only_equations_to_their_readers():
  params, data = _params(), _batches(5)
  plan = staged_plan(const_step, params, data[0], smart=True)
  (producer,) = plan.producers
  # The data-derived feature is staged with the iota and broadcast it reads.
  assert _primitives(producer) == [("iota", True), ("mul", False),
                                   ("broadcast_in_dim", True), ("add", False)]
  consumer = _primitives(plan.consumer)
  # cos(pos) + 1.5 and the closed-over constant's arithmetic: consumer only.
  for entry in [("iota", True), ("cos", True), ("add", True), ("mul", True),
                ("dot_general", False), ("tanh", False)]:
    assert entry in consumer, (entry, str(plan))
  assert "cos" not in {p for p, _ in _primitives(producer)}
  # The iota runs in both parts (the same equation), so only the feature is
  # carried from the producer to the consumer (which also receives the
  # closed-over array, as every part that reads it does).
  iota = [e.index for e in producer.equations if e.primitive == "iota"]
  assert iota == [e.index for e in plan.consumer.equations
                  if e.primitive == "iota"]
  assert producer.outputs == 1 and plan.consumer.inputs == 2
  assert all(e.constant == (e.primitive in ("iota", "broadcast_in_dim"))
             for e in producer.equations)
  assert "const" in str(plan)
  assert f"[{iota[0]:3d}] iota" in str(plan)

  want = [jax.jit(const_step)(params, b) for b in data]
  for mode in ("fused", "plain"):
    for capacity in (1, 3):
      with jaxstreams.staged(const_step, data=data, smart=True, mode=mode,
                             capacity=capacity) as runner:
        got = _run_all(runner, params)
      assert_equal_results(got, want)


def marker_step(params, batch):
  pos = jnp.arange(B, dtype=jnp.float32)
  f = jaxstreams.stage(batch["x"] + pos[:, None])      # constant feeds stage 0
  half = jaxstreams.stage(jnp.full((B, 4), 0.5, jnp.float32))   # of a constant
  g = jaxstreams.stage(jnp.sin(f) * jnp.exp(pos)[:, None])   # and stage 1
  return (jnp.sum(g @ params["w"]) + jnp.sum(half @ params["w"])
          + jnp.sum(pos))


@pytest.mark.parametrize("smart", [False, True])
def test_constants_feeding_stage_calls(smart):
  params, data = _params(), _batches(5)
  plan = staged_plan(marker_step, params, data[0], smart=smart)
  first, second = plan.producers
  # Stage 0: f (with the iota it reads) and the stage() of a constant, as
  # written; exp(pos) runs where it is read, in stage 1, not carried there.
  assert _primitives(first) == [
      ("iota", True), ("broadcast_in_dim", True), ("add", False),
      ("name", False), ("broadcast_in_dim", True), ("name", False)]
  assert _primitives(second) == [
      ("iota", True), ("sin", False), ("exp", True),
      ("broadcast_in_dim", True), ("mul", False), ("name", False)]
  assert ("iota", True) in _primitives(plan.consumer)
  assert ("reduce_sum", True) in _primitives(plan.consumer)   # sum(pos)
  # Carried: f to stage 1; half and g to the consumer. No constant.
  assert (first.outputs, second.inputs, second.outputs) == (2, 1, 1)
  assert plan.consumer.inputs == 2

  want = [jax.jit(marker_step)(params, b) for b in data]
  for mode in ("fused", "plain"):
    with jaxstreams.staged(marker_step, data=data, smart=smart,
                           mode=mode) as runner:
      assert_equal_results(_run_all(runner, params), want)


# ---------------------------------------------------------------------------
# Donation.

def two_stage(params, batch):
  f = jaxstreams.stage(batch["x"] * 2.0 + 1.0)     # read by stage 1 and
                                                   # consumer
  g = jaxstreams.stage(jnp.sin(f))                 # read by the consumer
  return jnp.sum((g + f) @ params["w"]), f * 0.5   # one output like f and g


def _staged_values(runner):
  """(batch index, array) of every staged value in flight."""
  fused = runner._fused            # the fused run (None before the first call)
  if fused is None:
    return []
  return [(e.index, x) for e in fused.inflight if e.split is not None
          for v, x in e.env.items() if v in e.split.staged]


def test_fused_donates_staged_values_never_the_batch():
  params, data = _params(), _batches(6)
  want = [jax.jit(two_stage)(params, b) for b in data]
  # Once the reader holds every batch, each call's program is the steady
  # pipeline's (no catch-up for a batch not read yet): the schedule is known.
  source, finished = _ready_source(data)
  got, donated = [], 0
  with jaxstreams.staged(two_stage, data=source, capacity=len(data) + 1,
                         mode="fused") as runner:
    got.append(runner(params))
    assert wait_until(lambda: finished[0], 10.0)
    for i in range(1, len(data)):
      before = _staged_values(runner)
      got.append(runner(params))
      names = runner.schedule[-1].split()
      assert names[-1] == f"C{i}"
      head = [x for index, x in before if index == i]
      rest = [x for index, x in before if index != i]
      # Batch i's f and g are dead after its consumer: donated, as many
      # as the program has outputs of their shape (one per part here).
      assert len(head) == 2
      assert sum(x.is_deleted() for x in head) == min(2, len(names))
      donated += sum(x.is_deleted() for x in head)
      # Later batches' values are still needed (stage 1 reads f, and so
      # does the consumer later): kept.
      assert not any(x.is_deleted() for x in rest)
      # The caller's arrays: placing them on the device returned them.
      assert not any(x.is_deleted() for b in data for x in _leaves(b))
    with pytest.raises(StopIteration):
      runner(params)
  assert donated > 0
  assert_equal_results(got, want)
  for b in data:
    np.asarray(b["x"])      # still readable


def test_plain_mode_donates_nothing():
  params, data = _params(), _batches(4)
  want = [jax.jit(two_stage)(params, b) for b in data]
  with jaxstreams.staged(two_stage, data=data, mode="plain") as runner:
    assert_equal_results(_run_all(runner, params), want)
  assert not any(x.is_deleted() for b in data for x in _leaves(b))


def _ready_source(data):
  """``data``'s items, and a flag set once the reader has pulled (so placed
  and stored) all of them: waiting for it makes every program the steady
  pipeline's."""
  finished = [False]

  def source():
    yield from data
    finished[0] = True
  return source(), finished


def test_consumer_error_with_donating_producer():
  """The consumer may raise (a callback), so it donates nothing; stage 1
  still donates f. When the consumer of batch 3 fails, the program that
  also ran stage 1 for batch 4 has taken f of batch 4, and the consumer's
  own error is raised by call 3."""
  params, data = _params(), _batches(6)

  def check(ids):
    if int(ids[0]) == 3:
      raise ValueError("consumer rejects batch 3")
    return ids

  def step(params, batch):
    f = jaxstreams.stage(batch["x"] * 2.0 + 1.0)
    g = jaxstreams.stage(jnp.sin(f))
    ids = jax.pure_callback(check, jax.ShapeDtypeStruct((B,), jnp.int32),
                            batch["ids"])
    return jnp.sum(g @ params["w"]) + jnp.sum(ids).astype(jnp.float32)

  plan = staged_plan(step, params, data[0])
  assert "pure_callback" in {e.primitive for e in plan.consumer.equations}
  want = [jax.jit(step)(params, b) for b in data[:3]]
  source, finished = _ready_source(data)
  runner = jaxstreams.staged(step, data=source, capacity=len(data) + 1,
                             mode="fused")
  got = [runner(params)]
  assert wait_until(lambda: finished[0], 10.0)
  for i in (1, 2, 3):
    before = _staged_values(runner)
    if i < 3:
      got.append(runner(params))
    else:
      with pytest.raises(Exception, match="consumer rejects batch 3"):
        runner(params)
    assert runner.schedule[-1] == f"A{i + 2} B{i + 1} C{i}"
    # Stage 1 donated f of batch i + 1; the consumer kept g of batch i.
    assert [x.is_deleted() for index, x in before] == [
        index == i + 1 for index, _ in before]
  assert_equal_results(got, want)
  with pytest.raises(StopIteration):
    runner(params)
  assert not any(x.is_deleted() for b in data for x in _leaves(b))


@pytest.mark.cpu_backend
def test_input_gone_after_a_failure_gives_the_original_error(monkeypatch):
  """Were a part that can fail to donate (here: the callback is not known to
  raise), the failed program takes the older batch's inputs with it: the
  error is then raised by the call that ran it, as itself, not as a
  deleted buffer. (XLA:CPU raises such a failure at the call; a GPU, with
  its results, which a failure staged does not know of cannot change.)"""
  monkeypatch.setattr(analysis_module, "_MAY_RAISE", frozenset())
  params, data = _params(), _batches(6)

  def check(ids):
    if int(ids[0]) == 3:
      raise ValueError("corrupt batch 3")
    return ids

  def step(params, batch):
    f = jaxstreams.stage(batch["x"] * 2.0 + 1.0)
    ids = jax.pure_callback(check, jax.ShapeDtypeStruct((B,), jnp.int32),
                            batch["ids"] + (f[:, 0] * 0).astype(jnp.int32))
    g = jaxstreams.stage(jnp.cos(f) + ids[:, None].astype(jnp.float32))
    return jnp.sum(g @ params["w"])

  source, finished = _ready_source(data)
  runner = jaxstreams.staged(step, data=source, capacity=len(data) + 1,
                             mode="fused")
  runner(params)
  assert wait_until(lambda: finished[0], 10.0)
  runner(params)
  with pytest.raises(Exception, match="corrupt batch 3") as info:
    runner(params)            # A4 B3 C2: batch 2's g went with it
  assert "deleted" not in str(info.value)
  assert runner.schedule[-1] == "A4 B3 C2"
  with pytest.raises(StopIteration):
    runner(params)
