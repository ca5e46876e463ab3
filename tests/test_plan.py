"""The plan: maximal acyclic regions, their dependencies, and the lowering."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import jaxstreams
from programs import (assert_equal_results, check_region_graph, cpu_text,
                      cuda_text, random_inputs, training_params, training_step,
                      two_towers)

# These read the GPU program's stream calls (or compare programs that have
# them): jaxstreams.jit functions are made with the 'streams' lowering.
pytestmark = pytest.mark.usefixtures("stream_calls")


def test_a_block_becomes_one_region():
  def f(x):
    with jaxstreams.stream(1):
      y = jnp.sin(x)
      y = jnp.cos(y) * 2
      y = jnp.exp(y).sum()
    return y + 1

  plan = jaxstreams.plan(f, streams=2)(jnp.ones(4))
  on_1 = [r for r in plan.regions if r.stream == 1]
  assert len(on_1) == 1
  assert set(on_1[0].equations) == {e.index for e in plan.equations
                                     if e.stream == 1}
  assert len(on_1[0].equations) >= 4
  assert len(plan.dependencies) == 1
  check_region_graph(plan)


def test_independent_work_on_one_stream_merges():
  def f(x, y):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
    m = jnp.cos(y)              # main stream, independent of a
    with jaxstreams.stream(1):
      b = jnp.exp(m)            # reads main, not a: may join a's region
    return a + b

  plan = jaxstreams.plan(f, streams=2)(jnp.ones(3), jnp.ones(3))
  assert len([r for r in plan.regions if r.stream == 1]) == 1
  check_region_graph(plan)


def test_a_merge_that_would_close_a_cycle_is_refused():
  def f(x):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
    m = a * 2                   # main reads stream 1
    with jaxstreams.stream(1):
      b = jnp.exp(m)            # stream 1 reads main: must be a new region
    return b

  plan = jaxstreams.plan(f, streams=2)(jnp.ones(3))
  on_1 = [r for r in plan.regions if r.stream == 1]
  assert len(on_1) == 2
  assert [r.stream for r in plan.regions] == [1, 0, 1]
  check_region_graph(plan)
  assert_equal_results(jaxstreams.jit(f, streams=2)(jnp.ones(3)),
                       jax.jit(f)(jnp.ones(3)))


def test_ancestry_through_a_grown_region_is_tracked():
  # R1 (stream 1) grows to read R2 (stream 2) *after* main read R1; a later
  # stream-2 equation reading main must then not join R2.
  def f(x):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
    m = a + 1                    # main depends on R1
    with jaxstreams.stream(2):
      b = jnp.cos(x)             # R2
    with jaxstreams.stream(1):
      c = jnp.exp(b)             # joins R1, so R1 now waits for R2
    with jaxstreams.stream(2):
      d = jnp.tanh(m)            # main -> R1 -> R2: joining R2 is a cycle
    return c + d

  plan = jaxstreams.plan(f, streams=3)(jnp.ones(3))
  check_region_graph(plan)
  assert_equal_results(jaxstreams.jit(f, streams=3)(jnp.ones(3)),
                       jax.jit(f)(jnp.ones(3)))


def test_implied_dependencies_are_dropped():
  def f(x):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
    with jaxstreams.stream(2):
      b = jnp.cos(a)
    return a + b     # main reads a directly, but also b which already waits
                     # on a

  plan = jaxstreams.plan(f, streams=3)(jnp.ones(3))
  pairs = {(d.producer_stream, d.consumer_stream) for d in plan.dependencies}
  assert pairs == {(1, 2), (2, 0)}
  check_region_graph(plan)


def test_training_step_plan_is_sound():
  params = training_params()
  x, y = random_inputs((8, 16), (8, 1), seed=3)
  plan = jaxstreams.plan(training_step, streams=3)(params, x, y)
  assert set(plan.streams_used) == {0, 1, 2}
  check_region_graph(plan)


def test_str_and_dot():
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  plan = jaxstreams.jit(two_towers, streams=3).plan(x, w1, w2)
  text = str(plan)
  assert text.startswith("StreamPlan for two_towers: streams=3")
  for header in ("region", "lowered as", "cross-stream dependencies",
                 "equations (rule", "call on stream 1", "call on stream 2",
                 "inline (main)"):
    assert header in text
  assert "programs.py" in text   # equations point at user source lines
  dot = plan.to_dot()
  assert dot.startswith('digraph "two_towers"') and dot.rstrip().endswith("}")
  assert "cluster_stream1" in dot and "cluster_stream2" in dot
  assert len(re.findall(r"R\d+ -> R\d+", dot)) >= 2


def test_lowering_emits_one_annotated_call_per_off_main_region():
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  f = jaxstreams.jit(two_towers, streams=3)
  plan = f.plan(x, w1, w2)
  text = cuda_text(f, x, w1, w2)
  calls = [c for c in re.findall(
      r"call @\S+\(.*?\{mhlo.frontend_attributes = \{(.*?)\}\}", text)
      if "_xla_stream_annotation" in c]
  found = sorted((int(re.search(r'jaxstreams_region = "(\d+)"', c).group(1)),
                  int(re.search(r'_xla_stream_annotation = "(\d+)"',
                                c).group(1)))
                 for c in calls)
  # Each call names the plan region it is (jaxstreams.xla_schedule reads it).
  assert found == sorted((r.index, r.stream) for r in plan.regions if r.is_call)
  assert all('inlineable = "false"' in c for c in calls)
  # On CPU the regions are lowered inline and the ordering barriers are
  # nothing: there is one stream there anyway.
  lowered_for_cpu = cpu_text(f, x, w1, w2)
  assert "_xla_stream_annotation" not in lowered_for_cpu
  assert "optimization_barrier" not in lowered_for_cpu


def test_single_stream_plan_says_so():
  plan = jaxstreams.plan(lambda x: jnp.sin(x) + 1)(jnp.ones(2))
  assert plan.is_single_stream and plan.streams == 1
  assert "everything runs on the main stream" in str(plan)
  text = cuda_text(jaxstreams.jit(lambda x: jnp.sin(x) + 1), jnp.ones(2))
  assert "_xla_stream_annotation" not in text


def test_plan_of_a_jaxstreams_function_uses_its_settings():
  f = jaxstreams.jit(lambda x, n: x * n, streams=2, static_argnums=1)
  assert jaxstreams.plan(f)(jnp.ones(2), 3).streams == 2
  assert jaxstreams.plan(f, streams=4)(jnp.ones(2), 3).streams == 4


def test_the_plan_is_a_frozen_report_of_names():
  """The user's plan is read-only data: value names, not the program that
  lowering emits, so nothing done to it can change what runs."""
  def f(x):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
    return a + jnp.cos(x) * 2.0

  plan = jaxstreams.plan(f, streams=2)(jnp.ones(3))
  for name in ("regions", "equations", "dependencies", "streams", "summary"):
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(plan, name, ())
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.regions[0].stream = 0
  assert not hasattr(plan, "_program") and not hasattr(plan, "_graph")
  sin, cos, mul, add = plan.equations
  assert (sin.primitive, sin.inputs, sin.outputs) == ("sin", ("a0",), ("v0",))
  assert mul.inputs == cos.outputs           # the literal 2.0 is not a value
  assert add.inputs == sin.outputs + mul.outputs
  assert plan.region_of(0).outputs == sin.outputs
  assert plan.edges == ((0, 1),) and plan.dependencies[0].values == ("v0",)



def test_cut_gives_each_part_its_inputs_outputs_and_function():
  """The one cutter partition, staging and serve use. A part's inputs are
  the values it reads and does not make, first read first; its outputs the
  values it makes that are read outside it, in program order. An equation
  in two parts runs in both, so its value is neither part's input."""
  from jaxstreams.partition import cut, part_function

  def f(x, y):
    k = jnp.arange(3.0) * 2.0
    a = jnp.sin(x) + k
    b = jnp.cos(y)
    return a * b + k, b, 1.0

  x_val, y_val = jnp.linspace(0.0, 1.0, 3), jnp.linspace(1.0, 2.0, 3)
  jaxpr = jax.make_jaxpr(f)(x_val, y_val).jaxpr
  eqns = jaxpr.eqns
  assert [e.primitive.name for e in eqns] == [
      "iota", "mul", "sin", "add", "cos", "mul", "add"]
  x, y = jaxpr.invars
  const, a, b, result = eqns[1].outvars[0], eqns[3].outvars[0], \
      eqns[4].outvars[0], eqns[6].outvars[0]
  members = [[0, 1, 2, 3], [0, 1, 4, 5, 6]]      # k is made by both parts

  first, second = cut(jaxpr, members, results_part=1)
  assert first.equations == (0, 1, 2, 3)
  assert first.inputs == (x,) and first.outputs == (a,)
  assert second.inputs == (y, a) and second.outputs == ()
  assert const not in first.outputs + second.inputs
  # Results read outside every part: each part outputs those it makes.
  assert cut(jaxpr, members)[1].outputs == (b, result)

  run_first = part_function(first.inputs, first.outputs,
                            [eqns[i] for i in first.equations])
  run_second = part_function(second.inputs, jaxpr.outvars,
                             [eqns[i] for i in second.equations])
  (a_val,) = run_first(x_val)
  for got, want in zip(run_second(y_val, a_val), f(x_val, y_val)):
    assert_equal_results(got, want)
