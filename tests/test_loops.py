"""Independent loops on different streams run as one loop, each body on its
stream (``jaxstreams.partition.loops``, ``jaxstreams.lower.loops``).

On CPU the results are bitwise those of ``jax.jit`` whatever the way; the
GPU program is read from the lowering for CUDA (no GPU needed). What XLA
compiles and launches from it is ``test_compile_matrix.py`` and
``test_gpu_view.py``'s.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxstreams
from jaxstreams import _compat
from programs import random_inputs


def _scan(ws, x):
  return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]


def towers(w1, w2, x):
  """Two scans over stacked layers on streams 1 and 2; main-stream work
  that needs neither."""
  with jaxstreams.stream(1):
    a = _scan(w1, x)
  with jaxstreams.stream(2):
    b = _scan(w2, x)
  return jnp.sum(a * b) + jnp.sum(jnp.cos(x))


@pytest.fixture
def args():
  w1, w2 = random_inputs((4, 32, 32), (4, 32, 32))
  return w1 * 0.2, w2 * 0.2, random_inputs((8, 32), seed=1)[0]


def _loops(text: str) -> int:
  return len(re.findall(r"stablehlo\.while", text))


def _cuda_text(f, *args) -> str:
  return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_independent_scans_are_grouped_each_alone_in_its_region(args):
  plan = jaxstreams.jit(towers, streams=3).plan(*args)
  (group,) = plan.loops
  assert len(group.regions) == 2 and group.steps == 4 and not group.reverse
  assert sorted(plan.regions[r].stream for r in group.regions) == [1, 2]
  for r in group.regions:
    (eqn,) = plan.regions[r].equations
    assert plan.equations[eqn].primitive == "scan"
  assert group.regions[1] == group.regions[0] + 1   # adjacent: emitted together
  text = str(plan)
  assert "R%d+R%d: 4 steps, bodies on streams 1, 2" % group.regions in text
  assert "loop body on stream 1, one loop with" in text


@pytest.mark.parametrize("way", ["default", "inline", "loops", "streams",
                                 "loops_concurrent"])
def test_results_are_bitwise_jax_jits_on_cpu(args, way):
  expected = jax.jit(towers)(*args)
  got = jaxstreams.jit(towers, streams=3, gpu_lowering=way)(*args)
  np.testing.assert_array_equal(got, expected)
  grad = jaxstreams.jit(jax.grad(towers, argnums=(0, 1)), streams=3,
                        gpu_lowering=way)(*args)
  for g, e in zip(grad, jax.jit(jax.grad(towers, argnums=(0, 1)))(*args)):
    np.testing.assert_array_equal(g, e)


def test_the_gpu_program_runs_the_group_as_one_loop_of_stream_calls(args):
  inline = _cuda_text(jaxstreams.jit(towers, streams=3, gpu_lowering="inline"),
                      *args)
  loops = _cuda_text(jaxstreams.jit(towers, streams=3, gpu_lowering="loops"),
                     *args)
  assert _loops(inline) == 2 and "_xla_stream_annotation" not in inline
  # The CPU branch keeps the two loops; the GPU branch has one, whose body
  # calls both towers, each on its stream.
  assert re.search(r'_xla_stream_annotation = "1"', loops)
  assert re.search(r'_xla_stream_annotation = "2"', loops)


def test_the_default_picks_loops_where_the_plan_has_them(args):
  plan = jaxstreams.jit(towers, streams=3).plan(*args)
  assert plan.gpu_lowering == "loops_concurrent"
  assert "loops" in plan.gpu_reason
  plain = jaxstreams.jit(lambda x, w: jnp.tanh(x @ w), streams=3).plan(
      args[2], args[0][0])
  assert plain.loops == ()


def test_gradient_loops_are_grouped_too(args):
  def step(w1, w2, x):
    return jax.value_and_grad(towers, argnums=(0, 1))(w1, w2, x)
  plan = jaxstreams.jit(step, streams=3).plan(*args)
  # The forward pass's two scans, and the backward pass's two (reversed).
  assert sorted(g.reverse for g in plan.loops) == [False, True]
  for group in plan.loops:
    assert sorted(plan.regions[r].stream for r in group.regions) == [1, 2]
  np.testing.assert_array_equal(
      jaxstreams.jit(step, streams=3, gpu_lowering="loops")(*args)[0],
      jax.jit(step)(*args)[0])


def test_what_is_not_grouped(args):
  w1, w2, x = args

  def dependent(w1, w2, x):
    with jaxstreams.stream(1):
      a = _scan(w1, x)
    with jaxstreams.stream(2):
      b = _scan(w2, a)   # needs the first tower
    return b.sum()

  def same_stream(w1, w2, x):
    with jaxstreams.stream(1):
      a = _scan(w1, x)
      b = _scan(w2, x)
    return (a + b).sum()

  def unequal(w1, w2, x):
    with jaxstreams.stream(1):
      a = _scan(w1, x)
    with jaxstreams.stream(2):
      b = _scan(w2[:2], x)
    return (a + b).sum()

  for fn in (dependent, same_stream, unequal):
    assert jaxstreams.jit(fn, streams=3).plan(w1, w2, x).loops == (), fn


def test_three_towers_make_one_group(args):
  w1, w2, x = args

  def three(w1, w2, x):
    outs = []
    for s, w in enumerate((w1, w2, w1 * 2)):
      with jaxstreams.stream(s):
        outs.append(_scan(w, x))
    return sum(o.sum() for o in outs)

  plan = jaxstreams.jit(three, streams=3).plan(w1, w2, x)
  (group,) = plan.loops
  assert sorted(plan.regions[r].stream for r in group.regions) == [0, 1, 2]
  np.testing.assert_array_equal(
      jaxstreams.jit(three, streams=3, gpu_lowering="loops")(w1, w2, x),
      jax.jit(three)(w1, w2, x))


@pytest.mark.skipif(_compat.jaxlib_version() < (0, 11),
                    reason="jaxlib 0.10 compiles a loop inside a stream call")
def test_a_lone_loop_cannot_be_a_stream_call_asked_for(args):
  """A loop with no partner stays in its region; from jaxlib 0.11 XLA cannot
  compile that region as a stream call (limits.py): asked for, it is an
  error naming the region; by default it runs in place."""
  w1, w2, x = args

  def lone(w1, x):
    with jaxstreams.stream(1):
      a = _scan(w1, x)
    return a.sum() + jnp.cos(x).sum()

  with pytest.raises(jaxstreams.LoweringError,
                     match=r"gpu_lowering='streams' cannot run region R\d "
                           r"\(stream 1\) as a stream call: it holds a loop"):
    _cuda_text(jaxstreams.jit(lone, streams=2, gpu_lowering="streams"), w1, x)
  nested = jax.jit(lambda w, x: jaxstreams.jit(lone, streams=2)(w, x))
  text = nested.trace(w1, x).lower(lowering_platforms=("cuda",)).as_text()
  assert "_xla_stream_annotation" not in text
