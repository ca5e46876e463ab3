"""Sequence points: how jaxstreams writes the plan's order into the GPU
program where XLA does not schedule stream regions itself (jax < 0.12), and
that nothing of it reaches CPU programs or results.

The compiled H100 schedules these produce are checked in test_gpu_compile.py;
these tests need no CUDA plugin.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from jaxstreams._compat import XLA_SCHEDULES_STREAM_CALLS
from jaxstreams.lower.order import overlappable_calls
from jaxstreams.lower.packing import Packing
from programs import (assert_equal_results, cuda_text, one_chain,
                      random_inputs, training_params, training_step, two_towers)

# These read the GPU program's stream calls (or compare programs that have
# them): jaxstreams.jit functions are made with the 'streams' lowering.
pytestmark = pytest.mark.usefixtures("stream_calls")


def mixed_outputs(x, w):
  """A region with float, integer and boolean outputs beside main-stream
  work it does not depend on."""
  with jaxstreams.stream(1):
    h = x @ w
    top = jnp.argmax(h, axis=1)
    positive = h > 0
    small = (h * 4).astype(jnp.int8)
    act = jnp.tanh(h)
  other = jnp.sin(x @ w.T)
  return (act * positive).sum() + top.sum() + small.sum() + other.sum()


def _partitioned(fn, *args, streams):
  """The PartitionedProgram jaxstreams emits for ``fn``."""
  from jaxstreams._jit_staged import make_plan
  plans = []
  jax.jit(lambda *a: plans.append(
      make_plan(fn, streams, None, "test", a, {})[0])).trace(*args)
  return plans[0]


def _barriers(text):
  return text.count('jaxstreams_order = "1"')


def test_only_regions_with_work_beside_them_are_pinned():
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  towers = _partitioned(two_towers, x, w1, w2, streams=3)
  assert overlappable_calls(towers) == {
      r for r, s in enumerate(towers.graph.streams) if s != 0}
  chain = _partitioned(one_chain, x, w1, streams=2)
  assert overlappable_calls(chain) == frozenset()


def test_the_gpu_program_carries_sequence_points_where_xla_needs_them():
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  text = cuda_text(jaxstreams.jit(two_towers, streams=3), x, w1, w2)
  if XLA_SCHEDULES_STREAM_CALLS:
    assert _barriers(text) == 0
  else:
    assert _barriers(text) >= 2   # the starts pinned, then each landing
  # One chain has nothing to overlap: its program is left as it was.
  w = random_inputs((16, 16), seed=1)[0]
  assert _barriers(cuda_text(jaxstreams.jit(one_chain, streams=2), x, w)) == 0


def test_the_option_turns_them_off():
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  jaxstreams.config.update("jaxstreams_sequence_points", False)
  try:   # (a new function: options are read when a function is traced)
    text = cuda_text(jaxstreams.jit(lambda *a: two_towers(*a), streams=3),
                     x, w1, w2)
  finally:
    jaxstreams.config.reset("jaxstreams_sequence_points")
  assert _barriers(text) == 0


@pytest.mark.skipif(XLA_SCHEDULES_STREAM_CALLS,
                    reason="regions are packed only where jaxstreams pins them")
def test_a_pinned_region_returns_one_buffer():
  x, w = random_inputs((8, 16), (16, 16))
  text = cuda_text(jaxstreams.jit(mixed_outputs, streams=2), x, w)
  calls = [line for line in text.splitlines()
           if "call @" in line and "_xla_stream_annotation" in line]
  assert len(calls) == 1
  # One result, of the floating outputs' dtype, holding all four outputs.
  assert re.search(r"-> tensor<\d+xf32>", calls[0]), calls[0]


def test_cpu_results_stay_those_of_jax_jit():
  x, w = random_inputs((8, 16), (16, 16))
  assert_equal_results(jaxstreams.jit(mixed_outputs, streams=2)(x, w),
                       jax.jit(mixed_outputs)(x, w))
  params = training_params()
  xs, ys = random_inputs((8, 16), (8, 1), seed=3)
  assert_equal_results(jaxstreams.jit(training_step, streams=3)(params, xs, ys),
                       jax.jit(training_step)(params, xs, ys))


def test_gradients_flow_through_packed_outputs():
  """jax.grad applied outside differentiates the emitted program, packing
  included: float outputs are concatenated and sliced, never bitcast."""
  x, w = random_inputs((8, 16), (16, 16))
  grad = jax.grad(jaxstreams.jit(mixed_outputs, streams=2), argnums=(0, 1))
  assert_equal_results(grad(x, w),
                       jax.grad(jax.jit(mixed_outputs), argnums=(0, 1))(x, w))
  # And it still lowers for a GPU, barriers and packing included.
  assert "_xla_stream_annotation" in cuda_text(jax.jit(grad), x, w)


@pytest.mark.parametrize("dtypes", [
    (jnp.float32, jnp.int32, jnp.bool_, jnp.int8, jnp.uint16, jnp.uint32),
    (jnp.bfloat16, jnp.bool_, jnp.int8, jnp.int16),
    (jnp.int32, jnp.bool_, jnp.uint8),
])
def test_packing_round_trips_exactly(dtypes):
  class Var:          # what Packing reads of a jaxpr variable: its aval
    def __init__(self, value):
      self.aval = jax.ShapeDtypeStruct(value.shape, value.dtype)

  rng = np.random.default_rng(0)
  values = []
  for k, dtype in enumerate(dtypes):
    shape = (3, k + 1)
    if dtype == jnp.bool_:
      values.append(jnp.asarray(rng.random(shape) > 0.5))
    elif jnp.issubdtype(dtype, jnp.integer):
      info = jnp.iinfo(dtype)
      values.append(jnp.asarray(rng.integers(max(info.min, -2**31),
                                             min(info.max, 2**31 - 1), shape),
                                dtype))
    else:
      values.append(jnp.asarray(rng.standard_normal(shape), dtype))
  outputs = [Var(v) for v in values]
  packing = Packing.of(outputs)
  assert packing is not None
  buffer = packing.pack(values)
  assert buffer.ndim == 1
  for var, value in zip(outputs, values):
    assert_equal_results(packing.unpack(buffer, var), value)


def test_what_cannot_be_packed_exactly_is_not():
  class Var:
    def __init__(self, dtype):
      self.aval = jax.ShapeDtypeStruct((2,), dtype)

  # Two floating dtypes: converting either way is inexact or loses gradients.
  assert Packing.of([Var(jnp.float32), Var(jnp.bfloat16)]) is None
  assert Packing.of([Var(jnp.float32), Var(jnp.complex64)]) is None
  assert Packing.of([Var(jnp.float32), Var(jnp.int16)]) is not None
