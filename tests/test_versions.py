"""What differs between the jax versions jaxstreams supports (0.10, 0.11, 0.12)
works on the one running the tests.

Closures: from jax 0.11 a jaxpr's constants are the leading inputs with values
attached, so a traced function that closes over arrays is where a version
difference shows first. Each closure below is checked bitwise against
``jax.jit`` and for a plan that names the constants as constants.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from programs import assert_bitwise_equal, random_inputs

NUMPY_WEIGHT = np.linspace(-1.0, 1.0, 16 * 16, dtype=np.float32).reshape(16, 16)
NUMPY_BIAS = np.arange(16, dtype=np.float32) / 7.0


def jax_constants():
  """Closed-over jax arrays (made on first use: no jax work at import)."""
  w, b = random_inputs((16, 16), (16,), seed=3)
  return w, b


def closing_over(w, b):
  """A two-stream function of ``x`` that reads ``w`` and ``b`` from its
  closure, on both streams and in the join."""
  def f(x):
    with jaxstreams.stream(1):
      h = jnp.tanh(x @ w) + b
    g = jnp.sin(x) * b
    return (h * g).sum(axis=0) + w[0]
  return f


@pytest.fixture(params=["numpy", "jax"])
def constants(request):
  if request.param == "numpy":
    return NUMPY_WEIGHT, NUMPY_BIAS
  return jax_constants()


def const_inputs(plan):
  """The constant names (c0, c1, ...) the plan's regions read."""
  return {name for region in plan.regions for name in region.inputs
          if name.startswith("c")}


@pytest.mark.parametrize("auto", [False, True])
def test_closure_over_arrays_bitwise_equal_to_jax_jit(constants, auto):
  f = closing_over(*constants)
  x, = random_inputs((8, 16))
  g = jaxstreams.jit(f, streams=2, auto=auto)
  assert_bitwise_equal(g(x), jax.jit(f)(x))
  plan = g.plan(x)
  # One argument; the closed-over arrays are constants, not arguments.
  argument_names = {name for region in plan.regions for name in region.inputs
                    if name.startswith("a")}
  assert argument_names == {"a0"}
  assert const_inputs(plan)
  assert any(region.stream == 1 for region in plan.regions)


@pytest.mark.parametrize("auto", [False, True])
def test_gradient_of_closure_bitwise_equal_to_jax_jit(constants, auto):
  f = closing_over(*constants)
  x, = random_inputs((8, 16), seed=1)

  def loss(x):
    return jnp.sum(f(x) ** 2)

  inside = jax.value_and_grad(loss)
  expected = jax.jit(inside)(x)
  assert_bitwise_equal(jaxstreams.jit(inside, streams=2, auto=auto)(x),
                       expected)
  # jax.grad applied from outside, to a jaxstreams function.
  outside = jax.jit(jax.grad(lambda x: jnp.sum(
      jaxstreams.jit(f, streams=2, auto=auto)(x) ** 2)))
  assert_bitwise_equal(outside(x), expected[1])


@pytest.mark.parametrize("auto", [False, True])
def test_closure_over_an_outer_jit_tracer(auto):
  x, w, b = random_inputs((8, 16), (16, 16), (16,), seed=2)

  def outer(w, b, x):
    return jaxstreams.jit(closing_over(w, b), streams=2, auto=auto)(x)

  def reference(w, b, x):
    return jax.jit(closing_over(w, b))(x)

  assert_bitwise_equal(jax.jit(outer)(w, b, x), jax.jit(reference)(w, b, x))
  grad = jax.jit(jax.grad(lambda w: outer(w, b, x).sum()))
  expected = jax.jit(jax.grad(lambda w: reference(w, b, x).sum()))
  assert_bitwise_equal(grad(w), expected(w))


def test_nested_jit_with_tags_closing_over_constants_is_inlined():
  w, b = jax_constants()
  x, = random_inputs((8, 16), seed=4)

  @jax.jit
  def inner(x):
    with jaxstreams.stream(1):
      y = jnp.tanh(x @ w) + NUMPY_BIAS
    return y * b

  def f(x):
    return inner(x) + inner(x * 2.0) + b

  g = jaxstreams.jit(f, streams=2)
  assert_bitwise_equal(g(x), jax.jit(f)(x))
  plan = g.plan(x)
  assert sum(region.stream == 1 for region in plan.regions) >= 1
  assert const_inputs(plan)


def test_closure_in_served_function():
  f = closing_over(*jax_constants())
  x, = random_inputs((8, 16), seed=5)
  with jaxstreams.serve(f, groups=2) as server:
    assert_bitwise_equal(server(x), jax.jit(f)(x))
