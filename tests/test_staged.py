"""jaxstreams.stage / jaxstreams.staged: the staged runner returns, batch by
batch, exactly what the plain loop ``for b in data: step(*args, b)`` returns,
for 1, 2 and 3 stages and several capacities; smart staging picks the
data-only subgraph; misuse gives errors that name the offending value; no
worker thread outlives the runner.

Every way is checked: ``mode="fused"`` (one jaxstreams.jit program per call
runs the consumer of batch k and the producer stages of the following
batches, ``A0; A1 B0; A2 B1 C0; ...``), ``mode="plain"`` (the
plain step on batches read in the caller's thread) and ``mode="measured"``
(the default) with its chooser replaced by one that switches between plain
and fused every few calls, so that every promise is checked across
switches. How ``mode="measured"`` chooses, with made-up measurements and a
fake clock, is in test_staged_measured.py. For the fused way the
device-overlap claim is checked structurally: the program lowered for CUDA
has the producer inside calls annotated with its stream and the consumer
outside them.

The reference is the step as one jitted program (how steps run): the staged
outputs are bitwise equal to it. Op-by-op eager execution of the same Python
function agrees only to rounding (XLA fuses a jitted reduction differently
from an eager one), for the staged and the unstaged jitted step alike.

Structure and values only, never timings.
"""

import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from jaxstreams.staging import staged_plan
from programs import assert_equal_results, jaxstreams_threads, wait_until


def _batches(n, seed=0):
  rng = np.random.default_rng(seed)
  return [{"ids": rng.integers(0, 1000, size=(8,), dtype=np.int32),
           "x": rng.standard_normal((8, 4)).astype(np.float32),
           "y": rng.standard_normal((8,)).astype(np.float32)} for _ in range(n)]


def _params():
  rng = np.random.default_rng(1)
  return {"w": jnp.asarray(rng.standard_normal((6, 3)), jnp.float32),
          "v": jnp.asarray(rng.standard_normal((3,)), jnp.float32)}


def _features(batch):
  # "Parsing and hashing": integer mixing and a cast, data only.
  h = (batch["ids"] * jnp.int32(0x1E3779B1)) ^ (batch["ids"] >> 3)
  return jnp.concatenate(
      [batch["x"], (h % 97).astype(jnp.float32)[:, None] / 97.0,
       jnp.sin(batch["x"][:, :1])], axis=1)


def step1(params, batch):
  f = jaxstreams.stage(_features(batch))
  pred = jnp.tanh(f @ params["w"]) @ params["v"]
  return jnp.mean((pred - batch["y"]) ** 2), pred


def step2(params, batch):
  f = jaxstreams.stage(_features(batch))
  g = jaxstreams.stage(jnp.cos(f) * 2.0 + f)
  return jnp.tanh(g @ params["w"]) @ params["v"] - batch["y"]


def step3(params, batch):
  f = jaxstreams.stage(_features(batch))
  g = jaxstreams.stage({"a": jnp.cos(f), "b": f * f})
  h = jaxstreams.stage(g["a"] + jnp.exp(-g["b"]))
  return {"out": jnp.tanh(h @ params["w"]) @ params["v"], "y": batch["y"]}


def _run(runner, *args):
  outs = []
  for _ in range(1000):
    try:
      outs.append(runner(*args))
    except StopIteration:
      return outs
  raise AssertionError("the runner never raised StopIteration")


def _assert_same(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert_equal_results(g, w)


@pytest.fixture
def mode(staged_mode):
  """Each way a staged runner runs (conftest's ``staged_mode``)."""
  return staged_mode


@pytest.mark.parametrize("step, n_stages", [(step1, 1), (step2, 2), (step3, 3)])
@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_outputs_identical_to_plain_loop(step, n_stages, capacity, mode):
  params, data = _params(), _batches(7)
  want = [jax.jit(step)(params, b) for b in data]
  with jaxstreams.staged(step, data=data, capacity=capacity,
                         mode=mode) as runner:
    got = _run(runner, params)
    plan = runner.staged_plan()
  _assert_same(got, want)
  assert len(plan.producers) == n_stages
  assert {level for level, _ in plan.boundaries} == set(range(1, n_stages + 1))
  assert plan.consumer.kind == "consumer"
  # The producer never holds an equation that reads the parameters.
  for spec in plan.producers:
    assert spec.equations and all(e.level is not None for e in spec.equations)


def test_stop_iteration_after_drain_and_threads_gone(mode):
  params, data = _params(), _batches(3)
  runner = jaxstreams.staged(step2, data=iter(data), capacity=2, mode=mode)
  assert len(_run(runner, params)) == 3
  assert jaxstreams_threads("jaxstreams-prefetch") == []
  with pytest.raises(StopIteration):
    runner(params)


def test_empty_data(mode):
  runner = jaxstreams.staged(step1, data=[], mode=mode)
  with pytest.raises(StopIteration):
    runner(_params())


def test_lookahead_bounded_by_capacity_per_stage(mode):
  params, data = _params(), _batches(30)
  pulled, calls, ahead = [0], [0], []

  def source():
    for b in data:
      pulled[0] += 1
      ahead.append(pulled[0] - calls[0])
      yield b

  capacity = 2
  with jaxstreams.staged(step3, data=source(), capacity=capacity,
                         mode=mode) as runner:
    for _ in range(30):
      runner(params)
      calls[0] += 1
  if mode == "plain":
    assert max(ahead) == 1      # each call reads its own batch, as a loop
  else:
    # At most K + 1 = 4 batches in the pipeline (the one consumed and one
    # per stage), `capacity` read ahead and one in the reader's hand; +1 as
    # above.
    assert max(ahead) <= 4 + capacity + 1 + 1
  assert pulled[0] == 30


@pytest.mark.parametrize("data_argnums", [0, 1, -2, (0,), [-2]])
def test_data_argnums(data_argnums, mode):
  """An int, or as jax spells static_argnums a sequence of one int."""
  params, data = _params(), _batches(4)
  scale = jnp.float32(0.5)
  position = (data_argnums if isinstance(data_argnums, int)
              else data_argnums[0])

  def step(a, b, c):
    args = [a, b, c]
    batch = args.pop(position)
    p, s = args
    f = jaxstreams.stage(_features(batch))
    return jnp.sum(jnp.tanh(f @ p["w"])) * s

  def call(batch):
    args = [params, scale]
    args.insert(position if position >= 0 else 3 + position, batch)
    return jax.jit(step)(*args)

  want = [call(b) for b in data]
  with jaxstreams.staged(step, data=data, data_argnums=data_argnums,
                         mode=mode) as runner:
    assert runner.data_argnums == position      # normalised to the int
    _assert_same(_run(runner, params, scale), want)


def test_step_returning_constants(mode):
  """Outputs that are constants of the step (literals in its jaxpr, or an
  argument passed straight through) come back as the plain step's."""
  def step(params, batch):
    f = jaxstreams.stage(_features(batch))
    return jnp.sum(f @ params["w"]), 1.0, params["v"], batch["y"]

  params, data = _params(), _batches(4)
  want = [jax.jit(step)(params, b) for b in data]
  with jaxstreams.staged(step, data=data, mode=mode) as runner:
    got = _run(runner, params)
  _assert_same(got, want)
  assert all(g[1].dtype == w[1].dtype and g[1].weak_type == w[1].weak_type
             for g, w in zip(got, want))


def test_jaxstreams_jit_and_jax_jit_steps(mode):
  params, data = _params(), _batches(4)
  want = [jax.jit(step1)(params, b) for b in data]
  for wrapped in (jaxstreams.jit(step1, streams=2), jax.jit(step1)):
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b: bool(jnp.all(a == b)), wrapped(params, data[0]), want[0]))
    with jaxstreams.staged(wrapped, data=data, capacity=2, mode=mode) as runner:
      _assert_same(_run(runner, params), want)
      assert len(runner.staged_plan().producers) == 1


def test_training_step_with_grad(mode):
  data = _batches(5)

  def step(params, batch):
    f = jaxstreams.stage(_features(batch))
    def loss(p):
      return jnp.mean((jnp.tanh(f @ p["w"]) @ p["v"] - batch["y"]) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params,
                                         grads)

  params, want = _params(), []
  for b in data:
    value, params = jax.jit(step)(params, b)
    want.append((value, params))
  params, got = _params(), []
  with jaxstreams.staged(step, data=data, mode=mode) as runner:
    for _ in data:
      value, params = runner(params)   # parameters change every step
      got.append((value, params))
    with pytest.raises(StopIteration):
      runner(params)
  _assert_same(got, want)


def test_smart_stages_the_data_only_subgraph():
  params, data = _params(), _batches(5)

  def step(params, batch):
    f = _features(batch)                      # data only: staged
    g = jnp.tanh(f @ params["w"])             # reads params: consumer
    return jnp.sum(g @ params["v"]) + jnp.sum(batch["y"] * 2.0)

  plan = staged_plan(step, params, data[0], smart=True)
  assert len(plan.producers) == 1 and plan.smart
  producer = plan.producers[0].equations
  assert {e.primitive for e in producer} >= {"mul", "xor", "concatenate", "sin"}
  assert all(e.level == 0 for e in producer)
  consumer = {e.primitive for e in plan.consumer.equations}
  assert "dot_general" in consumer and "tanh" in consumer
  assert "concatenate" not in consumer and "sin" not in consumer
  assert "stage 0 (producer)" in str(plan) and "smart" in str(plan)

  want = [jax.jit(step)(params, b) for b in data]
  for mode in ("fused", "plain"):
    with jaxstreams.staged(step, data=data, smart=True, capacity=2,
                           mode=mode) as runner:
      _assert_same(_run(runner, params), want)
      assert runner.plan.smart


def test_smart_widens_beyond_stage_calls():
  params, data = _params(), _batches(3)

  def step(params, batch):
    f = jaxstreams.stage(batch["x"] * 2.0)
    g = jnp.sin(f) + (batch["ids"] % 7).astype(jnp.float32)[:, None]
    return jnp.sum(g) * params["v"][0]

  plain = staged_plan(step, params, data[0])
  smart = staged_plan(step, params, data[0], smart=True)
  assert "sin" not in {e.primitive for e in plain.producers[0].equations}
  assert "sin" in {e.primitive for e in smart.producers[0].equations}
  want = [jax.jit(step)(params, b) for b in data]
  for is_smart in (False, True):
    for mode in ("fused", "plain"):
      with jaxstreams.staged(step, data=data, smart=is_smart,
                             mode=mode) as runner:
        _assert_same(_run(runner, params), want)


def test_producer_reading_parameters_is_an_error_naming_them(mode):
  def step(params, batch):
    f = jaxstreams.stage(batch["x"] @ params["w"][:4])
    return jnp.sum(f)

  runner = jaxstreams.staged(step, data=_batches(3), mode=mode)
  with pytest.raises(ValueError, match=r"depends on args\[0\]\['w'\], which is "
                     r"not the data argument args\[1\]"):
    runner(_params())
  with pytest.raises(StopIteration):
    runner(_params())
  with pytest.raises(ValueError, match=r"args\[0\]\['w'\]"):
    staged_plan(step, _params(), _batches(1)[0])


def test_no_stage_call_without_smart_is_an_error():
  def step(params, batch):
    return jnp.sum(batch["x"]) * params["v"][0]

  with pytest.raises(ValueError,
                     match="calls no jaxstreams.stage().*smart=True"):
    jaxstreams.staged(step, data=_batches(2))(_params())


def test_stage_inside_nested_jit_is_an_error():
  @jax.jit
  def features(batch):
    return jaxstreams.stage(batch["x"] * 2)

  def step(params, batch):
    return jnp.sum(features(batch)) * params["v"][0]

  with pytest.raises(ValueError, match="inside a nested"):
    staged_plan(step, _params(), _batches(1)[0])


def test_stage_outside_a_staged_step_is_the_identity():
  x = np.arange(3.0)
  tree = {"a": x, "b": [jnp.ones(2)]}
  assert jaxstreams.stage(tree) is tree
  assert jaxstreams.stage(x) is x
  params, batch = _params(), _batches(1)[0]
  _assert_same([jax.jit(step2)(params, batch)], [step2(params, batch)])
  _assert_same([jaxstreams.jit(step2, streams=2)(params, batch)],
               [step2(params, batch)])
  grad = jax.grad(lambda x: jnp.sum(jaxstreams.stage(jnp.sin(x))))(jnp.ones(3))
  np.testing.assert_array_equal(grad, jnp.cos(jnp.ones(3)))


def test_data_exception_raised_at_its_batch(mode):
  params, data = _params(), _batches(3)

  def source():
    yield data[0]
    yield data[1]
    raise OSError("unreadable file 2")

  runner = jaxstreams.staged(step2, data=source(), capacity=2, mode=mode)
  runner(params)
  runner(params)
  with pytest.raises(OSError, match="unreadable file 2"):
    runner(params)
  with pytest.raises(StopIteration):
    runner(params)


@pytest.mark.parametrize("mode", ["fused", "plain"])
def test_other_argument_shape_change_is_an_error_while_staging(mode):
  params, data = _params(), _batches(3)
  with jaxstreams.staged(step1, data=data, mode=mode) as runner:
    runner(params)
    other = {"w": jnp.ones((6, 5)), "v": jnp.ones(5)}
    if mode == "plain":     # the plain step takes what the step takes
      _assert_same([runner(other)], [jax.jit(step1)(other, data[1])])
    else:
      with pytest.raises(ValueError, match="other arguments changed"):
        runner(other)


@pytest.mark.parametrize("stream", [0, 1, 3])
def test_stream_option_keeps_results(stream, mode):
  params, data = _params(), _batches(4)
  want = [jax.jit(step2)(params, b) for b in data]
  with jaxstreams.staged(step2, data=data, stream=stream, capacity=2,
                         mode=mode) as runner:
    _assert_same(_run(runner, params), want)


@pytest.mark.parametrize("mode, workers", [("fused", 1), ("plain", 0)])
def test_abandoned_runner_stops_its_workers(mode, workers):
  def forever():
    b = _batches(1)[0]
    while True:
      yield b

  runner = jaxstreams.staged(step3, data=forever(), capacity=1, mode=mode)
  runner(_params())
  # Fused: the reader only. Plain: none.
  assert len(jaxstreams_threads("jaxstreams-prefetch")) == workers
  del runner
  gc.collect()
  assert wait_until(lambda: jaxstreams_threads("jaxstreams-prefetch") == [],
                    10.0)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(capacity=0), ValueError, "capacity must be >= 1, got 0"),
    (dict(capacity="2"), TypeError, "capacity must be an integer >= 1"),
    (dict(stream=-1), ValueError, "stream must be >= 0"),
    (dict(stream=1.0), TypeError, "stream must be None or an integer >= 0"),
    (dict(data_argnums="x"), TypeError, r"data_argnums must be an int or a "
     r"sequence of exactly one int \(the position of the data argument, -1 "
     r"for the last\), got 'x' of type str"),
    (dict(data_argnums=True), TypeError, "data_argnums must be an int or a "
     "sequence of exactly one int .*, got True of type bool"),
    (dict(data_argnums=1.0), TypeError, "got 1.0 of type float"),
    (dict(data_argnums=None), TypeError, "got None of type NoneType"),
    (dict(data_argnums=["0"]), TypeError, r"got \['0'\] of type list"),
    (dict(data_argnums=(0, 1)), ValueError, r"data_argnums must be an int or "
     r"a sequence of exactly one int .*: staged reads one data argument, got "
     r"\(0, 1\)"),
    (dict(data_argnums=[]), ValueError, r"staged reads one data argument, got "
     r"\[\]"),
    (dict(data_argnum=0), TypeError, "unexpected keyword argument "
     "'data_argnum'"),
    (dict(smart=1), TypeError, "smart must be True or False"),
    (dict(mode="threads"), ValueError, r"mode must be one of \('measured', "
     r"'fused', 'plain'\), got 'threads'"),
    (dict(mode="auto"), ValueError, r"mode must be one of \('measured', "
     r"'fused', 'plain'\), got 'auto'"),
    (dict(mode=None), ValueError, "mode must be one of"),
])
def test_argument_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxstreams.staged(step1, data=[], **kwargs)


def test_bad_step_and_data():
  with pytest.raises(TypeError, match="step must be callable"):
    jaxstreams.staged(3, data=[])
  with pytest.raises(TypeError,
                     match="data must be an iterable of batches, got 5"):
    jaxstreams.staged(step1, data=5)
  with pytest.raises(ValueError, match="data_argnums=5 does not name"):
    jaxstreams.staged(step1, data=_batches(2), data_argnums=5)(_params())


@pytest.mark.parametrize("static", [dict(static_argnums=0),
                                    dict(static_argnames="params")])
def test_step_with_static_arguments_is_an_error_as_in_serve(static):
  step = jaxstreams.jit(step1, streams=2, **static)
  for make in (lambda: jaxstreams.staged(step, data=_batches(2)),
               lambda: jaxstreams.serve(step)):
    with pytest.raises(TypeError, match=f"{next(iter(static))}; .* passes "
                       "every argument as an array"):
      make()


def test_staged_plan_before_first_call_is_an_error():
  runner = jaxstreams.staged(step1, data=_batches(2))
  with pytest.raises(RuntimeError, match="has not traced a batch yet"):
    runner.staged_plan()


# ---------------------------------------------------------------------------
# Fused mode: one program per call, a software pipeline, producer on a stream.

def _seed_004(n_batches, k):
  """Seed 004's programs for ``k`` producer stages (letters A.., the
  consumer the letter after them) over ``n_batches`` batches."""
  programs = []
  for tick in range(n_batches + k):
    names = [f"{chr(ord('A') + j)}{tick - j}" for j in range(k + 1)
             if 0 <= tick - j < n_batches]
    programs.append(" ".join(names))
  return programs


@pytest.mark.parametrize("step, k", [(step1, 1), (step2, 2), (step3, 3)])
@pytest.mark.parametrize("capacity", [1, 3])
def test_fused_runs_seed_004_pipeline(step, k, capacity):
  params, data = _params(), _batches(6)
  want = [jax.jit(step)(params, b) for b in data]
  with jaxstreams.staged(step, data=data, capacity=capacity,
                         mode="fused") as runner:
    got = _run(runner, params)
    schedule, programs = runner.schedule, runner.programs_run
    assert runner.stats()["mode"] == "fused"
  _assert_same(got, want)
  ideal = _seed_004(len(data), k)
  # The first call warms up exactly as the pipeline does: A0; A1 B0; ...
  assert schedule[:k] == ideal[:k]
  if programs == len(ideal):      # the reader kept up: one program per call
    assert schedule == ideal
  # Whatever the reader's timing: every batch runs its stages in order, one
  # per program, and the consumer takes the batches in order.
  consumer = chr(ord("A") + k)
  seen = {}
  for program in schedule:
    for name in program.split():
      letter, batch = name[0], int(name[1:])
      assert seen.get(batch, -1) == ord(letter) - ord("A") - 1, schedule
      seen[batch] = ord(letter) - ord("A")
  consumed = [int(n[1:]) for p in schedule for n in p.split()
              if n[0] == consumer]
  assert consumed == list(range(len(data)))


def _functions(module_text):
  """Function name -> its text, from a lowered module's text."""
  functions = {}
  for part in re.split(r"\n\s*func\.func ", module_text)[1:]:
    name = re.match(r"(?:public |private )?@([\w.$-]+)", part).group(1)
    functions[name] = part
  return functions


def _closure(functions, name):
  """The text of ``name`` and of every function it calls, transitively."""
  todo, seen, text = [name], set(), []
  while todo:
    current = todo.pop()
    if current in seen:
      continue
    seen.add(current)
    text.append(functions[current])
    todo.extend(re.findall(r"call @([\w.$-]+)\(", functions[current]))
  return "\n".join(text)


def _stream_calls(module_text):
  """stream -> the text of the functions its annotated calls in main run."""
  functions = _functions(module_text)
  calls = re.findall(r"call @([\w.$-]+)\(.*_xla_stream_annotation = \"(\d+)\"",
                     functions["main"])
  by_stream = {}
  for callee, stream in calls:
    by_stream.setdefault(int(stream), []).append(_closure(functions, callee))
  main = re.sub(r"call @[\w.$-]+\(.*_xla_stream_annotation.*", "",
                functions["main"])
  return {s: "\n".join(texts) for s, texts in by_stream.items()}, main


@pytest.mark.parametrize("step, producer_ops, consumer_ops", [
    (step1, ["xor", "sine", "concatenate"], ["tanh", "dot_general"]),
    (step2, ["xor", "cosine"], ["tanh", "dot_general"]),
    (step3, ["xor", "cosine", "exponential"], ["tanh", "dot_general"]),
])
def test_fused_program_puts_the_producer_on_its_stream_for_cuda(
    stream_calls,
    step, producer_ops, consumer_ops):
  params, data = _params(), _batches(3)
  with jaxstreams.staged(step, data=data, mode="fused") as runner:
    runner(params)
    assert (runner.stream, runner.streams) == (1, 2)
    program, args = runner.step_program()
    text = program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  by_stream, main = _stream_calls(text)
  assert set(by_stream) == {1}, text
  for op in producer_ops:           # the producer: in the stream-1 call only
    assert f"stablehlo.{op}" in by_stream[1], (op, text)
    assert f"stablehlo.{op}" not in main, (op, text)
  for op in consumer_ops:           # the consumer: inline on the main stream
    assert f"stablehlo.{op}" in main, (op, text)
    assert f"stablehlo.{op}" not in by_stream[1], (op, text)


def test_fused_producer_stream_beside_a_jaxstreams_jit_step(stream_calls):
  params, data = _params(), _batches(4)

  @jaxstreams.jit(streams=3)
  def towers(params, batch):
    f = jaxstreams.stage(_features(batch))
    with jaxstreams.stream(1):
      a = jnp.tanh(f @ params["w"])
    with jaxstreams.stream(2):
      b = jnp.cos(f @ params["w"])
    return jnp.sum((a + b) @ params["v"])

  want = [towers(params, b) for b in data]
  with jaxstreams.staged(towers, data=data, mode="fused") as runner:
    got = _run(runner, params)
    # stream=None: the first stream the step does not use itself.
    assert (runner.stream, runner.streams) == (3, 4)
    program, args = runner.step_program()
    text = program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  _assert_same(got, want)
  by_stream, main = _stream_calls(text)
  assert set(by_stream) == {1, 2, 3}, text
  assert "stablehlo.xor" in by_stream[3] and "stablehlo.xor" not in main
  assert ("stablehlo.tanh" in by_stream[1]
          and "stablehlo.tanh" not in by_stream[3])
  assert "stablehlo.cosine" in by_stream[2]


def test_fused_program_runs_the_default_gpu_way():
  """The producer is a region: by default, at top level, XLA's CONCURRENT
  graphs run it beside the consumer (jaxstreams.lower.gpu)."""
  params, data = _params(), _batches(3)
  with jaxstreams.staged(step2, data=data, mode="fused") as runner:
    runner(params)
    program, args = runner.step_program()
    assert program.plan(*args).gpu_lowering == "concurrent"
    lowered = program.trace(*args).lower(lowering_platforms=("cuda",))
  assert dict(lowered._lowering._compiler_options_kvs) == {
      "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


@pytest.mark.parametrize("stream", [0, 2])
def test_fused_explicit_stream(stream, stream_calls):
  params, data = _params(), _batches(3)
  with jaxstreams.staged(step2, data=data, stream=stream,
                         mode="fused") as runner:
    runner(params)
    assert (runner.stream, runner.streams) == (stream, stream + 1)
    program, args = runner.step_program()
    text = program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  by_stream, main = _stream_calls(text)
  if stream == 0:                   # on the main stream: no call, no overlap
    assert by_stream == {} and "stablehlo.xor" in main
  else:   # the only off-main stream: XLA stream 1 (lower.calls.xla_stream)
    assert set(by_stream) == {1} and "stablehlo.xor" in by_stream[1]


def test_fused_batches_of_different_shapes():
  params = _params()
  data = _batches(5) + [
      {k: v[:3] for k, v in b.items()} for b in _batches(3, seed=7)]
  want = [jax.jit(step2)(params, b) for b in data]
  with jaxstreams.staged(step2, data=data, mode="fused") as runner:
    _assert_same(_run(runner, params), want)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_producer_stage_failure_raised_at_its_batch(mode, k):
  params, data = _params(), _batches(10)
  for i, b in enumerate(data):
    b["ids"][0] = i

  def check(ids):
    if int(ids[0]) == k:
      raise ValueError(f"corrupt batch {k}")
    return ids

  def step(params, batch):
    f = jaxstreams.stage(_features(batch))
    # Reads the staged f: the callback runs in producer stage B.
    ids = jax.pure_callback(check, jax.ShapeDtypeStruct((8,), jnp.int32),
                            batch["ids"] + (f[:, 0] * 0).astype(jnp.int32))
    g = jaxstreams.stage(jnp.cos(f) + ids[:, None].astype(jnp.float32))
    return jnp.sum(jnp.tanh(g @ params["w"]) @ params["v"])

  want = [jax.jit(step)(params, b) for b in data[:k]]
  plan = staged_plan(step, params, data[0])
  assert "pure_callback" in {e.primitive for e in plan.producers[1].equations}
  runner = jaxstreams.staged(step, data=data, capacity=2, mode=mode)
  got = [runner(params) for _ in range(k)]
  _assert_same(got, want)
  with pytest.raises(Exception, match=f"corrupt batch {k}"):
    runner(params)
  with pytest.raises(StopIteration):
    runner(params)


def test_step_program_needs_a_runner_that_ran():
  runner = jaxstreams.staged(step1, data=_batches(2), mode="plain")
  with pytest.raises(RuntimeError, match="needs a runner that has run a call"):
    runner.step_program()
  assert runner.schedule == [] and runner.programs_run == 0
  runner(_params())
  program, args = runner.step_program()
  assert callable(program) and args
  assert runner.schedule == [] and runner.programs_run == 0


def test_fused_plain_step_with_its_own_stream_blocks():
  """A plain step whose consumer uses stream(2): the fused program has the
  streams its blocks need, and the producer goes above them."""
  def step(w, batch):
    feats = jaxstreams.stage(jnp.sin(batch) * 2.0)
    with jaxstreams.stream(2):
      h = jnp.tanh(feats @ w)
    return h.sum()

  w = jnp.ones((4, 4)) * 0.1
  batches = [jnp.full((3, 4), float(i)) for i in range(5)]
  runner = jaxstreams.staged(step, data=iter(batches), mode="fused")
  outs = [runner(w) for _ in batches]
  with pytest.raises(StopIteration):
    runner(w)
  expected = [jax.jit(step)(w, b) for b in batches]
  for a, e in zip(outs, expected):
    np.testing.assert_array_equal(a, e)
  assert (runner.stream, runner.streams) == (3, 4)


def _scaled_step(params, batch):
  scale = jaxstreams.stage(batch * 2)
  return params["w"] * scale


def test_mixed_python_and_numpy_scalars_keep_the_plain_steps_dtypes(mode):
  # A Python float is weakly typed (bf16 * 1.0 stays bfloat16), a numpy
  # scalar is not (bf16 * np.float32(1.0) is float32): batches of each kind,
  # mixed, must each get the dtype the plain step gives them.
  params = {"w": jnp.ones((3,), jnp.bfloat16)}
  data = [1.0, np.float32(1.0), 2.0, np.float32(3.0), np.float32(0.5), 4.0]
  want = [jax.jit(_scaled_step)(params, b) for b in data]
  assert {w.dtype for w in want} == {jnp.dtype(jnp.bfloat16),
                                    jnp.dtype(jnp.float32)}
  with jaxstreams.staged(_scaled_step, data=data, mode=mode) as runner:
    got = [runner(params) for _ in data]
  assert [g.dtype for g in got] == [w.dtype for w in want]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                  np.asarray(w, np.float32))
