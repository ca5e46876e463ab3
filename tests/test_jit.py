"""jaxstreams.jit is a drop-in for jax.jit: same results, same conventions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxstreams
from programs import (GPU_TOLERANCE, assert_equal_results, cuda_text,
                      random_inputs, training_params, training_step, two_towers)

# These read the GPU program's stream calls (or compare programs that have
# them): jaxstreams.jit functions are made with the 'streams' lowering.
pytestmark = pytest.mark.usefixtures("stream_calls")


def test_three_decorator_forms_give_jax_jit_results():
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  expected = jax.jit(two_towers)(x, w1, w2)

  @jaxstreams.jit(streams=3)
  def decorated(x, w1, w2):
    return two_towers(x, w1, w2)

  assert_equal_results(jaxstreams.jit(two_towers, streams=3)(x, w1, w2),
                       expected)
  assert_equal_results(decorated(x, w1, w2), expected)
  jaxstreams.config.update("jaxstreams_streams", 3)
  try:
    bare = jaxstreams.jit(two_towers)
    assert_equal_results(bare(x, w1, w2), expected)
    assert bare.plan(x, w1, w2).streams == 3
  finally:
    jaxstreams.config.reset()


def test_training_step_and_gradients_bitwise_equal():
  params = training_params()
  x, y = random_inputs((32, 16), (32, 1), seed=1)
  expected = jax.jit(training_step)(params, x, y)
  actual = jaxstreams.jit(training_step, streams=3)(params, x, y)
  assert_equal_results(actual, expected)


def test_pytrees_in_and_out():
  def f(tree, scale):
    with jaxstreams.stream(1):
      a = {k: jnp.sin(v) * scale for k, v in tree["a"].items()}
    return {"a": a, "b": [tree["b"][0] + 1, (tree["b"][1] * 2,)], "none": None}

  tree = {"a": {"x": jnp.arange(4.0), "y": jnp.ones((2, 2))},
          "b": [jnp.zeros(3), jnp.full((2,), 3.0)]}
  assert_equal_results(jaxstreams.jit(f, streams=2)(tree, 0.5),
                       jax.jit(f)(tree, 0.5))


def test_static_argnums_and_argnames():
  calls = []

  def f(x, n, *, mode):
    calls.append((n, mode))
    with jaxstreams.stream(1):
      y = x * n
    return y + 1 if mode == "add" else y - 1

  g = jaxstreams.jit(f, streams=2, static_argnums=1, static_argnames="mode")
  x = jnp.arange(3.0)
  np.testing.assert_array_equal(g(x, 2, mode="add"), x * 2 + 1)
  np.testing.assert_array_equal(g(x, 3, mode="sub"), x * 3 - 1)
  g(x, 2, mode="add")
  assert calls == [(2, "add"), (3, "sub")]


def test_donated_arguments_are_donated():
  def f(x, y):
    with jaxstreams.stream(1):
      z = x * 2
    return z + y

  g = jaxstreams.jit(f, streams=2, donate_argnums=0)
  x, y = jnp.arange(4.0), jnp.ones(4)
  out = g(x, y)
  np.testing.assert_array_equal(out, jnp.arange(4.0) * 2 + 1)
  assert x.is_deleted()
  assert "tf.aliasing_output" in g.lower(jnp.arange(4.0), y).as_text() or \
      "jax.buffer_donor" in g.lower(jnp.arange(4.0), y).as_text()


def test_sharded_inputs_on_several_cpu_devices():
  devices = np.array(jax.devices("cpu")[:4])
  assert len(devices) == 4, "conftest asks JAX for 4 CPU devices"
  mesh = jax.sharding.Mesh(devices, ("data",))
  sharding = NamedSharding(mesh, P("data"))
  x = jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding)
  w1, w2 = random_inputs((4, 4), (4, 4))

  f = jaxstreams.jit(two_towers, streams=3, in_shardings=(sharding, None, None))
  assert_equal_results(f(x, w1, w2), jax.jit(two_towers)(x, w1, w2))

  def rowwise(x):
    with jaxstreams.stream(1):
      return jnp.sin(x) * 2

  g = jaxstreams.jit(rowwise, streams=2, out_shardings=sharding)
  out = g(x)
  assert out.sharding.is_equivalent_to(sharding, 2)
  assert_equal_results(out, jax.jit(rowwise)(x))


def test_second_call_does_not_retrace_or_replan(monkeypatch):
  traces = []
  plans = []
  import jaxstreams._pipeline as jit_module
  real_plan_program = jit_module.plan_program

  def counting_plan_program(*args, **kwargs):
    plans.append(1)
    return real_plan_program(*args, **kwargs)

  monkeypatch.setattr(jit_module, "plan_program", counting_plan_program)

  def f(x):
    traces.append(1)
    with jaxstreams.stream(1):
      return jnp.sin(x)

  g = jaxstreams.jit(f, streams=2)
  for _ in range(3):
    g(jnp.ones(3))
  assert (len(traces), len(plans)) == (1, 1)
  g(jnp.ones(4))            # a new shape: one more trace and plan
  g(jnp.ones(3, jnp.int32))  # a new dtype: one more
  g(jnp.ones(4))
  assert (len(traces), len(plans)) == (3, 3)


def test_grad_vmap_and_jvp_applied_outside():
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  f = jaxstreams.jit(two_towers, streams=3)
  assert_equal_results(jax.jit(jax.grad(f, argnums=(1, 2)))(x, w1, w2),
                       jax.jit(jax.grad(two_towers, argnums=(1, 2)))(x, w1, w2))
  xs = jnp.stack([x, x * 2])
  assert_equal_results(jax.jit(jax.vmap(f, (0, None, None)))(xs, w1, w2),
                       jax.jit(jax.vmap(two_towers, (0, None, None)))(
                           xs, w1, w2))
  tangents = (jnp.ones_like(x), jnp.zeros_like(w1), jnp.zeros_like(w2))
  assert_equal_results(
      jax.jit(lambda *a: jax.jvp(f, a, tangents))(x, w1, w2),
      jax.jit(lambda *a: jax.jvp(two_towers, a, tangents))(x, w1, w2))
  # Eagerly too (no outer jit): the eager gradient of a jitted function is
  # not bitwise that of the plain one, even on CPU.
  rtol = 1e-5 if jax.default_backend() == "cpu" else GPU_TOLERANCE
  np.testing.assert_allclose(jax.grad(f)(x, w1, w2),
                             jax.grad(two_towers)(x, w1, w2), rtol=rtol)


def test_regions_stay_calls_under_grad_from_outside():
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  f = jaxstreams.jit(two_towers, streams=3)
  text = cuda_text(jax.jit(jax.grad(f, argnums=1)), x, w1, w2)
  assert '_xla_stream_annotation = "1"' in text
  assert '_xla_stream_annotation = "2"' in text


def test_closing_over_traced_values():
  w = jnp.arange(3.0)

  def outer(w):
    f = jaxstreams.jit(lambda x: two_parts(x, w), streams=2)
    return f(jnp.ones(3)).sum()

  def two_parts(x, w):
    with jaxstreams.stream(1):
      a = jnp.sin(x * w)
    return a + w

  assert_equal_results(jax.jit(jax.grad(outer))(w),
                       jax.jit(jax.grad(
                           lambda w: (jnp.sin(jnp.ones(3) * w) + w).sum()))(w))


def test_works_on_methods():
  class Model:
    def __init__(self, scale):
      self.scale = scale

    @functools.partial(jaxstreams.jit, streams=2, static_argnums=0)
    def apply(self, x):
      with jaxstreams.stream(1):
        return x * self.scale

  m = Model(3.0)
  # jax.jit needs the instance to be hashable to be static; default object
  # hashing by identity is enough.
  np.testing.assert_array_equal(m.apply(jnp.ones(2)), jnp.full(2, 3.0))


def test_lower_and_trace_are_jax_jits():
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  f = jaxstreams.jit(two_towers, streams=3)
  lowered = f.lower(x, w1, w2)
  compiled = lowered.compile()
  assert_equal_results(compiled(x, w1, w2), jax.jit(two_towers)(x, w1, w2))
  assert f.eval_shape(x, w1, w2).shape == ()


def test_single_stream_lowers_exactly_like_jax_jit():
  """streams=1 with no blocks must build the program jax.jit builds."""
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))

  def plain(x, w1, w2):
    return (jnp.tanh(x @ w1) * jnp.sin(x @ w2)).sum()

  ours = jaxstreams.jit(plain).lower(x, w1, w2).as_text()
  theirs = jax.jit(plain).lower(x, w1, w2).as_text()
  assert ours == theirs


def test_other_xla_metadata_calls_still_lower_on_cpu():
  """jaxstreams changes the CPU lowering of its own region calls only; a
  user's own xla_metadata_call keeps JAX's lowering (a call op) and runs."""
  from jaxstreams import _compat
  from jaxstreams.lower import calls
  meta_call = _compat.xla_metadata_call
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  jaxstreams.jit(two_towers, streams=3)(x, w1, w2)   # installs the CPU rule
  assert calls._region_rules_installed

  def f(x):
    return meta_call(lambda y: jnp.sin(y) * 2, scheduling_group="g")(x) + 1

  x = jnp.arange(4.0)
  text = jax.jit(f).lower(x).as_text()
  assert 'scheduling_group = "g"' in text and "call @" in text
  np.testing.assert_array_equal(jax.jit(f)(x), jnp.sin(x) * 2 + 1)


def test_spec_of_answers_for_jaxstreams_jit_functions_only():
  """One accessor says what ``jaxstreams.jit`` was given (serve and staged
  unwrap with it); nothing private is set on jax's jit object."""
  from jaxstreams._jit import spec_of

  def f(x):
    return x * 2

  fixed = jaxstreams.jit(f, streams=2, donate_argnums=0)
  from_option = jaxstreams.jit(f)
  assert (spec_of(fixed).fun, spec_of(fixed).streams) == (f, 2)
  assert spec_of(fixed).jit_kwargs == {"donate_argnums": 0}
  assert (spec_of(from_option).fun, spec_of(from_option).streams) == (f, None)
  for other in (f, jax.jit(f), functools.partial(f), [f], None):
    assert spec_of(other) is None
  assert not any(name.startswith("_jaxstreams") for name in dir(fixed))
