"""The jaxstreams_gpu_lowering option: how a plan of several streams runs on a
GPU (jaxstreams.lower.gpu). 'default' is XLA's CONCURRENT CUDA graphs over
the program jax.jit builds at top level, or the way timed fastest; the other
ways force one. Read when the function is made. On CPU every way gives the
results of jax.jit."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from jaxstreams._compat import XLA_SCHEDULES_STREAM_CALLS
from jaxstreams.lower import gpu
from programs import (assert_equal_results, cpu_text, cuda_text, random_inputs,
                      two_towers)

CONCURRENT = "xla_gpu_command_buffer_scheduling_mode"


@pytest.fixture
def args():
  return random_inputs((8, 16), (16, 16), (16, 16))


def _stream_calls(text):
  return text.count("_xla_stream_annotation")


def _options(f, *args):
  return dict(f.lower(*args)._lowering._compiler_options_kvs)


def test_default_is_jax_jits_program_with_concurrent_graphs_at_top_level(args):
  f = jaxstreams.jit(two_towers, streams=3)
  assert len({r.stream for r in f.plan(*args).regions}) == 3
  text = cuda_text(f, *args)
  assert _stream_calls(text) == 0 and "optimization_barrier" not in text
  assert _options(f, *args) == {CONCURRENT: "CONCURRENT"}
  assert_equal_results(f(*args), jax.jit(two_towers)(*args))


def test_default_inside_another_jit_has_no_compiler_options(args):
  """jax refuses compiler options below the top level; the default there is
  what this XLA runs side by side: stream calls from jax 0.12."""
  f = jaxstreams.jit(two_towers, streams=3)
  outer = jax.jit(lambda *a: f(*a))
  calls = _stream_calls(cuda_text(outer, *args))
  assert (calls > 0) == XLA_SCHEDULES_STREAM_CALLS
  assert not dict(outer.lower(*args)._lowering._compiler_options_kvs)
  assert_equal_results(outer(*args), jax.jit(two_towers)(*args))
  assert_equal_results(jax.grad(lambda *a: f(*a))(*args),
                       jax.grad(jax.jit(two_towers))(*args))


@pytest.mark.parametrize("way", list(gpu.WAYS))
def test_each_way_builds_its_program_and_options(args, way):
  f = jaxstreams.jit(two_towers, streams=3, gpu_lowering=way)
  plan = f.plan(*args)
  assert plan.gpu_lowering == way and gpu.WAYS[way].summary in plan.gpu_reason
  expected_calls = (sum(r.is_call for r in plan.regions)
                    if way.startswith("streams") else 0)
  assert _stream_calls(cuda_text(f, *args)) == expected_calls
  assert _stream_calls(cpu_text(f, *args)) == 0      # CPU: in place either way
  assert ((_options(f, *args).get(CONCURRENT) == "CONCURRENT")
          == way.endswith("concurrent"))
  assert_equal_results(f(*args), jax.jit(two_towers)(*args))
  assert_equal_results(jax.jit(lambda *a: f(*a))(*args),
                       jax.jit(two_towers)(*args))


def test_one_stream_is_jax_jits_program_whatever_the_way(args):
  f = jaxstreams.jit(lambda x: jnp.sin(x) * 2, streams=3,
                     gpu_lowering="concurrent")
  plan = f.plan(args[0])
  assert plan.is_single_stream and plan.gpu_lowering == "inline"


def test_the_option_is_read_when_the_function_is_made(args):
  jaxstreams.config.update("jaxstreams_gpu_lowering", "streams")
  try:
    calls = jaxstreams.jit(two_towers, streams=3)
    by_option = jaxstreams.jit(two_towers)      # streams from the option
  finally:
    jaxstreams.config.reset("jaxstreams_gpu_lowering")
  default = jaxstreams.jit(two_towers, streams=3)
  # The same function made both ways: neither finds the other's trace.
  assert _stream_calls(cuda_text(calls, *args)) > 0
  assert _stream_calls(cuda_text(default, *args)) == 0
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
  assert (jaxstreams.plan(f, gpu_lowering="inline")(*args).gpu_lowering
          == "inline")
  assert jaxstreams.plan(f, streams=4)(*args).gpu_lowering == "streams"
  with pytest.raises(ValueError,
                     match=r"jaxstreams.jit: gpu_lowering must be one "
                     r"of 'default', 'inline', 'concurrent', 'loops', "
                     r"'loops_concurrent', 'streams', 'streams_concurrent' or "
                     r"None .* got 'fast'"):
    jaxstreams.jit(two_towers, streams=3, gpu_lowering="fast")


def test_a_bad_value_names_the_choices():
  with pytest.raises(ValueError,
                     match=r"jaxstreams_gpu_lowering .* must be one of "
                     r"default, inline, concurrent, loops, loops_concurrent, "
                     r"streams, streams_concurrent, got 'fast'"):
    jaxstreams.config.update("jaxstreams_gpu_lowering", "fast")


def test_the_option_takes_the_ways_lowering_defines():
  """The option's values (config, the bottom floor) are the ways
  ``jaxstreams.lower.gpu`` defines, in its order."""
  assert (jaxstreams.config.GPU_LOWERINGS == gpu.NAMES
          == (gpu.DEFAULT, *gpu.WAYS))


def test_profiling_lowers_stream_calls_under_the_default(args):
  f = jaxstreams.jit(two_towers, streams=3)
  with jaxstreams.profile() as prof:
    out = f(*args)
  assert ({i.track for i in prof.intervals}
          == {r.stream for r in f.plan(*args).regions})
  # The markers change the program a little (as in test_profile).
  np.testing.assert_allclose(out, jax.jit(two_towers)(*args), rtol=1e-6)


def _plan_text(args, autotune):
  jaxstreams.config.update("jaxstreams_autotune", autotune)
  try:
    return str(jaxstreams.jit(two_towers, streams=3).plan(*args))
  finally:
    jaxstreams.config.reset("jaxstreams_autotune")


def test_the_plan_says_how_its_regions_run_on_a_gpu(args):
  text = _plan_text(args, autotune=True)
  assert "on a GPU: 'concurrent', the program jax.jit builds" in text
  assert "the calls after it time inline, concurrent" in text
  assert "inside another jit: " in text
  text = _plan_text(args, autotune=False)
  assert "the top-level default (jaxstreams_autotune is off)" in text
  assert "call on stream" not in text
  jaxstreams.config.update("jaxstreams_gpu_lowering", "streams")
  try:
    f = jaxstreams.jit(two_towers, streams=3)
  finally:
    jaxstreams.config.reset("jaxstreams_gpu_lowering")
  plan = f.plan(*args)    # the option changed since: the plan is of what f runs
  assert plan.gpu_lowering == "streams"
  assert "call on stream 1" in str(plan)


def test_the_users_compiler_options_come_first(args):
  # jax.jit's compiler_options pass through, over the way's own (XLA:CPU
  # ignores the GPU options).
  options = {CONCURRENT: "LHS", "xla_gpu_enable_command_buffer": ""}
  f = jaxstreams.jit(two_towers, streams=3, compiler_options=options)
  assert _options(f, *args) == options
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
  assert sorted(set(re.findall(r'_xla_stream_annotation = "(\d+)"',
                               text))) == ["1", "2"]
  assert_equal_results(f(*args), jax.jit(spread)(*args))
