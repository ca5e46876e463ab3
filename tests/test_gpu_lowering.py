"""The jaxstreams_gpu_lowering option: how a plan of several streams runs on a
GPU. 'inline' (default) is the program jax.jit builds; 'streams' makes each
off-main region a call on its stream. Read when the function is made."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from programs import (assert_equal_results, cpu_text, cuda_text, random_inputs,
                      two_towers)


@pytest.fixture
def args():
  return random_inputs((8, 16), (16, 16), (16, 16))


def _stream_calls(text):
  return text.count("_xla_stream_annotation")


def test_default_lowers_a_plan_of_several_streams_as_jax_jit_does(args):
  f = jaxstreams.jit(two_towers, streams=3)
  assert len({r.stream for r in f.plan(*args).regions}) == 3
  text = cuda_text(f, *args)
  assert _stream_calls(text) == 0
  assert "optimization_barrier" not in text
  assert_equal_results(f(*args), jax.jit(two_towers)(*args))


def test_streams_lowering_makes_one_call_per_off_main_region(args, stream_calls):
  f = jaxstreams.jit(two_towers, streams=3)
  plan = f.plan(*args)
  assert _stream_calls(cuda_text(f, *args)) == sum(r.is_call for r in plan.regions) > 0
  assert _stream_calls(cpu_text(f, *args)) == 0      # CPU: inline either way
  assert_equal_results(f(*args), jax.jit(two_towers)(*args))


def test_the_option_is_read_when_the_function_is_made(args):
  jaxstreams.config.update("jaxstreams_gpu_lowering", "streams")
  try:
    calls = jaxstreams.jit(two_towers, streams=3)
    by_option = jaxstreams.jit(two_towers)      # streams from the option
  finally:
    jaxstreams.config.reset("jaxstreams_gpu_lowering")
  inline = jaxstreams.jit(two_towers, streams=3)
  # The same function made both ways: neither finds the other's trace.
  assert _stream_calls(cuda_text(calls, *args)) > 0
  assert _stream_calls(cuda_text(inline, *args)) == 0
  assert _stream_calls(cuda_text(calls, *args)) > 0
  # streams=None: made at the first call with each stream count, under the
  # option as it is then.
  jaxstreams.config.update("jaxstreams_streams", 3)
  try:
    assert _stream_calls(cuda_text(by_option, *args)) == 0
  finally:
    jaxstreams.config.reset("jaxstreams_streams")


def test_the_keyword_chooses_for_one_function(args):
  f = jaxstreams.jit(two_towers, streams=3, gpu_lowering="streams")
  assert _stream_calls(cuda_text(f, *args)) > 0
  assert f.plan(*args).gpu_lowering == "streams"
  assert jaxstreams.plan(f, gpu_lowering="inline")(*args).gpu_lowering == "inline"
  assert jaxstreams.plan(f, streams=4)(*args).gpu_lowering == "streams"
  with pytest.raises(ValueError, match=r"jaxstreams.jit: gpu_lowering must be one "
                     r"of 'inline', 'streams' or None .* got 'fast'"):
    jaxstreams.jit(two_towers, streams=3, gpu_lowering="fast")


def test_a_bad_value_names_the_choices():
  with pytest.raises(ValueError, match=r"jaxstreams_gpu_lowering .* must be one "
                     r"of inline, streams, got 'fast'"):
    jaxstreams.config.update("jaxstreams_gpu_lowering", "fast")


def test_profiling_lowers_stream_calls_under_the_default(args):
  f = jaxstreams.jit(two_towers, streams=3)
  with jaxstreams.profile() as prof:
    out = f(*args)
  assert {i.track for i in prof.intervals} == {r.stream for r in f.plan(*args).regions}
  # The markers change the program a little (as in test_profile).
  np.testing.assert_allclose(out, jax.jit(two_towers)(*args), rtol=1e-6)


def test_the_plan_says_how_its_regions_run_on_a_gpu(args):
  text = str(jaxstreams.jit(two_towers, streams=3).plan(*args))
  assert "on a GPU the regions run inline, as the program jax.jit builds" in text
  assert "call on stream" not in text
  jaxstreams.config.update("jaxstreams_gpu_lowering", "streams")
  try:
    f = jaxstreams.jit(two_towers, streams=3)
  finally:
    jaxstreams.config.reset("jaxstreams_gpu_lowering")
  plan = f.plan(*args)    # the option changed since: the plan is of what f runs
  assert plan.gpu_lowering == "streams"
  assert "call on stream 1" in str(plan) and "run inline" not in str(plan)


def test_xla_concurrent_scheduling_can_be_asked_for_as_with_jax_jit(args):
  # The README's way to the fastest program measured on an H100: jax.jit's
  # compiler_options, passed through (XLA:CPU ignores the option).
  options = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
  f = jaxstreams.jit(two_towers, streams=3, compiler_options=options)
  assert_equal_results(f(*args), jax.jit(two_towers)(*args))


def test_stream_calls_number_xla_streams_densely(args, stream_calls):
  def spread(x, w1, w2):
    with jaxstreams.stream(5):
      a = jnp.tanh(x @ w1)
    with jaxstreams.stream(9):
      b = jnp.sin(x @ w2)
    return a + b
  f = jaxstreams.jit(spread, streams=10)
  assert {r.stream for r in f.plan(*args).regions} == {0, 5, 9}
  text = cuda_text(f, *args)
  assert sorted(set(re.findall(r'_xla_stream_annotation = "(\d+)"', text))) == ["1", "2"]
  assert_equal_results(f(*args), jax.jit(spread)(*args))
