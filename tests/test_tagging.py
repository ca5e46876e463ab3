"""stream() tags survive JAX's transformations and control flow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxstreams
from programs import (assert_equal_results, cuda_text, random_inputs,
                      training_params, training_step)

# These read the GPU program's stream calls (or compare programs that have
# them): jaxstreams.jit functions are made with the 'streams' lowering.
pytestmark = pytest.mark.usefixtures("stream_calls")


def streams_by_name(plan, fragment):
  return {e.stream for e in plan.equations if fragment in e.name}


def test_nested_blocks_innermost_wins_and_outer_is_restored():
  def f(x):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
      with jaxstreams.stream(2):
        b = jnp.cos(a)
      c = jnp.exp(b)
    return c + 1

  plan = jaxstreams.plan(f, streams=3)(jnp.ones(3))
  by_prim = {e.primitive: e.stream for e in plan.equations}
  assert by_prim == {"sin": 1, "cos": 2, "exp": 1, "add": 0}
  assert [e.rule for e in plan.equations] == ["user", "user", "user", "main"]


def test_gradients_follow_their_forward_stream():
  params = training_params()
  x, y = random_inputs((8, 16), (8, 1), seed=1)
  plan = jaxstreams.plan(training_step, streams=3)(params, x, y)
  backward = [e for e in plan.equations if "transpose(" in e.name]
  assert backward, "the plan should contain backward-pass equations"
  for e in backward:
    if "jaxstreams_stream_1" in e.name:
      assert e.stream == 1, e
    elif "jaxstreams_stream_2" in e.name:
      assert e.stream == 2, e
  assert {e.stream for e in backward} >= {1, 2}


def test_include_grad_false_leaves_the_backward_pass_untagged():
  def step(w, x):
    def loss(w):
      with jaxstreams.stream(1, include_grad=False):
        h = jnp.tanh(x @ w)
      return (h ** 2).sum()
    return jax.grad(loss)(w)

  w, x = random_inputs((4, 4), (2, 4))
  plan = jaxstreams.plan(step, streams=2)(w, x)
  forward = [e for e in plan.equations
             if "jaxstreams_stream_1" in e.name and "transpose(" not in e.name]
  backward = [e for e in plan.equations
              if "jaxstreams_stream_1" in e.name and "transpose(" in e.name]
  assert forward and backward
  assert {e.stream for e in forward} == {1}
  assert {e.stream for e in backward} == {0}
  assert_equal_results(jaxstreams.jit(step, streams=2)(w, x),
                       jax.jit(step)(w, x))


def test_grad_inside_a_block_is_placed_on_it():
  def f(x):
    with jaxstreams.stream(1, include_grad=False):
      g = jax.grad(lambda y: jnp.sin(y).sum())(x)   # the user put this here
    return g * 2

  plan = jaxstreams.plan(f, streams=2)(jnp.ones(3))
  assert {e.stream for e in plan.equations if e.primitive != "mul"} == {1}


def test_vmap_inside_keeps_tags():
  def f(xs, w):
    def one(x):
      with jaxstreams.stream(1):
        return jnp.tanh(x @ w)
    return jax.vmap(one)(xs).sum()

  xs, w = random_inputs((5, 3, 4), (4, 4))
  plan = jaxstreams.plan(f, streams=2)(xs, w)
  assert streams_by_name(plan, "jaxstreams_stream_1") == {1}
  assert_equal_results(jaxstreams.jit(f, streams=2)(xs, w), jax.jit(f)(xs, w))


@pytest.mark.parametrize("kind", ["scan", "cond", "while_loop", "checkpoint"])
def test_control_flow_runs_whole_on_its_stream(kind):
  def body_fn(x):
    return jnp.sin(x) * 1.5

  def f(x):
    with jaxstreams.stream(1):
      if kind == "scan":
        y = lax.scan(lambda c, _: (body_fn(c), None), x, None, length=3)[0]
      elif kind == "cond":
        y = lax.cond(x.sum() > 0, body_fn, jnp.cos, x)
      elif kind == "while_loop":
        y = lax.while_loop(lambda c: c[0] < 3,
                           lambda c: (c[0] + 1, body_fn(c[1])), (0, x))[1]
      else:
        y = jax.checkpoint(body_fn)(x)
    return y + x

  x = jnp.linspace(-1.0, 1.0, 6)
  plan = jaxstreams.plan(f, streams=2)(x)
  container = [e for e in plan.equations if e.primitive not in ("add", "gt",
                                                                "reduce_sum")]
  assert container and all(e.stream == 1 for e in container), plan
  assert_equal_results(jaxstreams.jit(f, streams=2)(x), jax.jit(f)(x))
  if kind == "while_loop":
    return  # jax has no reverse mode for while_loop
  assert_equal_results(jaxstreams.jit(jax.grad(lambda x: f(x).sum()),
                                      streams=2)(x),
                       jax.jit(jax.grad(lambda x: f(x).sum()))(x))


def test_tags_inside_a_loop_body_move_the_whole_loop():
  def f(x):
    def body(c, _):
      with jaxstreams.stream(1):
        c = jnp.sin(c)
      return c, None
    return lax.scan(body, x, None, length=4)[0] * 2

  plan = jaxstreams.plan(f, streams=2)(jnp.ones(3))
  scan = next(e for e in plan.equations if e.primitive == "scan")
  assert (scan.stream, scan.rule) == (1, "body")


def test_a_loop_body_asking_for_two_streams_is_reported():
  def f(x):
    def body(c, _):
      with jaxstreams.stream(1):
        a = jnp.sin(c)
      with jaxstreams.stream(2):
        b = jnp.cos(c)
      return a + b, None
    return lax.scan(body, x, None, length=4)[0]

  plan = jaxstreams.plan(f, streams=3)(jnp.ones(3))
  scan = next(e for e in plan.equations if e.primitive == "scan")
  assert scan.stream == 0 and "streams 1, 2" in scan.note
  assert any("streams 1, 2" in n for n in plan.notes)
  assert "streams 1, 2" in str(plan)
  assert_equal_results(jaxstreams.jit(f, streams=3)(jnp.ones(3)),
                       jax.jit(f)(jnp.ones(3)))


def test_nested_jit_bodies_are_inlined_so_their_tags_count():
  @jax.jit
  def inner(x):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
    with jaxstreams.stream(2):
      b = jnp.cos(x)
    return a * b

  def f(x):
    return inner(x) + inner(x * 2)

  plan = jaxstreams.plan(f, streams=3)(jnp.ones(3))
  assert {e.primitive: e.stream for e in plan.equations
          if e.primitive in ("sin", "cos")} == {"sin": 1, "cos": 2}
  assert sum(e.primitive == "sin" for e in plan.equations) == 2
  assert_equal_results(jaxstreams.jit(f, streams=3)(jnp.ones(3)),
                       jax.jit(f)(jnp.ones(3)))
  text = cuda_text(jaxstreams.jit(f, streams=3), jnp.ones(3))
  assert text.count('_xla_stream_annotation = "1"') >= 1


def test_untagged_nested_jit_stays_one_equation():
  inner = jax.jit(lambda x: jnp.sin(x) * 2)
  plan = jaxstreams.plan(lambda x: inner(x) + 1, streams=2)(jnp.ones(3))
  assert [e.primitive for e in plan.equations][0] in ("jit", "pjit")


def test_colocate_with_follows_the_producer():
  def f(x):
    with jaxstreams.stream(2):
      a = jnp.sin(x)
    b = jnp.cos(x)
    with jaxstreams.colocate_with(a):
      c = a * 3
    with jaxstreams.colocate_with(x):   # an argument: the main stream
      d = b + 1
    return c + d

  plan = jaxstreams.plan(f, streams=3)(jnp.ones(3))
  rows = {e.primitive: (e.stream, e.rule) for e in plan.equations}
  assert rows["mul"] == (2, "colocate")
  assert rows["add"][1] in ("colocate", "main")
  assert [e for e in plan.equations if e.primitive == "add"][0].stream == 0
  assert_equal_results(jaxstreams.jit(f, streams=3)(jnp.ones(3)),
                       jax.jit(f)(jnp.ones(3)))


def test_stream_outside_any_trace_is_a_no_op():
  with jaxstreams.stream(5):
    y = jnp.sin(jnp.ones(2))
  np.testing.assert_array_equal(y, jnp.sin(jnp.ones(2)))
  # Inside plain jax.jit the tags are recorded but nobody acts on them.
  assert_equal_results(jax.jit(lambda x: _tagged(x))(jnp.ones(2)),
                       jnp.sin(jnp.ones(2)) + 1)


def _tagged(x):
  with jaxstreams.stream(1):
    return jnp.sin(x) + 1


def test_side_effects_stay_on_the_main_stream():
  def f(x):
    with jaxstreams.stream(1):
      y = jnp.sin(x)
      jax.debug.callback(lambda v: None, y)
    return y

  plan = jaxstreams.plan(f, streams=2)(jnp.ones(2))
  callback = next(e for e in plan.equations if "callback" in e.primitive)
  assert (callback.stream, callback.rule) == (0, "effects")
  assert "side effects" in callback.note
  np.testing.assert_array_equal(jaxstreams.jit(f, streams=2)(jnp.ones(2)),
                                jnp.sin(jnp.ones(2)))
