"""What each way needs on the device, stated in the plan; and the default
never running out of memory where ``jax.jit``'s program fits.

XLA's memory analysis of programs compiled for an H100 without one (needs
the CUDA plugin: skips without it, fails with
``JAXSTREAMS_REQUIRE_GPU_TARGET=1``), and a pretend device whose free memory
the tests choose (``jaxstreams.lower.memory.free_bytes``).
"""

import re

import jax
import jax.numpy as jnp
import pytest

import jaxstreams
from jaxstreams import _compat
from jaxstreams.lower import gpu, memory
from jaxstreams.xla import ways as way_reports

import compile_matrix
from programs import (assert_equal_results, four_branches,
                      four_branches_args, require_gpu_target, towers_args,
                      tuned_towers)
from programs import compiles, untimed_gpu  # noqa: F401 - fixtures


# ---------------------------------------------------------------------------
# Stated: every way compiled for a target.

@pytest.fixture(scope="module")
def stated():
  """Scanned towers, their plan with every way compiled for an H100 (one
  child process), and the arguments."""
  require_gpu_target()
  fn, args, streams = compile_matrix.PROGRAMS["scan_towers"]()
  f = jaxstreams.jit(fn, streams=streams, gpu_lowering="loops_concurrent")
  return f, f.plan(*args, target="h100"), args


def test_the_plan_states_each_way_s_memory_against_jax_jit_s(stated):
  f, plan, args = stated
  report = plan.memory
  assert [(w.way, w.nested) for w in report.ways] == [
      ("inline", False), ("loops_concurrent", False), ("loops", True)]
  argument_bytes = sum(a.size * a.dtype.itemsize for a in args)
  for way in report.ways:
    assert way.note == "" and way.footprint is not None, way
    # Every way takes the same arguments and returns the same results.
    assert way.footprint.arguments == argument_bytes
    assert way.footprint.outputs == report.baseline.footprint.outputs
    assert way.needed == way.footprint.needed
    # The view of what the GPU launches for the way, with its memory.
    assert way.graphs.memory == way.footprint
    assert "device memory (XLA's analysis)" in way.graphs.summary()
    assert way.seconds == way.graphs.estimate.step > 0
    assert report.ratio(way.way, way.nested) == pytest.approx(
        way.needed / report.baseline.needed)
  text = str(plan)
  assert ("device memory of each way (XLA's memory analysis, compiled for "
          "h100 without a GPU; jax.jit's program is 'inline'):") in text
  assert "\n    loops (inside another jit)  " in text
  assert ("GPU step est.: the GPU step estimate of the way's program on the "
          "target") in text
  # The planner's own figure is named apart from it.
  assert "planner's makespan: " in text and "estimated step" not in text


def test_the_figures_are_xla_s_own(stated):
  """The child's figure for jax.jit's program is what compiling it here,
  for the same target, says."""
  f, plan, args = stated
  target = jaxstreams.gpu_target("h100")
  compiled = f._jit(gpu.WAYS["inline"], top_level=True).lower(
      *target.abstract(*args)).compile()
  assert plan.memory.baseline.footprint == memory.footprint(compiled)


def test_which_ways_are_stated():
  fn, args, streams = compile_matrix.PROGRAMS["scan_towers"]()
  f = jaxstreams.jit(fn, streams=streams)
  plan = f.plan(*args)
  assert way_reports.ways_of(f, plan) == (
      [(w, False) for w in gpu.candidates(plan)]
      + [(gpu.default_nested(), True)])
  asked = jaxstreams.jit(fn, streams=streams, gpu_lowering="concurrent")
  assert [(w.name, n) for w, n in way_reports.ways_of(asked, plan)] == [
      ("inline", False), ("concurrent", False), ("inline", True)]
  assert "not compiled yet (f.plan(*args, target='h100')" in str(plan)


def test_a_function_s_own_target_argument_is_its_own():
  def shifted(x, target):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
    return a + target
  f = jaxstreams.jit(shifted, streams=2)
  plan = f.plan(jnp.ones(3), target=jnp.ones(3))   # traced, not compiled
  assert plan.memory is None and len(plan.regions) == 2


def test_the_table_reads_as_multiples_of_jax_jit_s_program():
  mb = 2**20
  report = memory.WaysMemory("pretend", (
      memory.WayMemory("inline",
                       footprint=memory.Footprint(40 * mb, 8 * mb, 2 * mb)),
      memory.WayMemory("concurrent",
                       footprint=memory.Footprint(60 * mb, 8 * mb, 2 * mb)),
      memory.WayMemory("streams", note="did not lower: LoweringError")))
  assert report.ratio("concurrent") == pytest.approx(70 / 50)
  assert report.ratio("streams") is None
  lines = report.lines()
  assert lines[0] == ("device memory of each way (pretend; jax.jit's program "
                      "is 'inline'):")
  assert lines[1].split() == ["way", "temporaries", "arguments", "outputs",
                              "for", "a", "call", "vs", "jax.jit",
                              "temporaries", "vs", "jax.jit"]
  assert lines[3].split() == ["concurrent", "60.0", "MiB", "8.0", "MiB", "2.0",
                              "MiB", "70.0", "MiB", "1.40x", "1.50x"]
  assert lines[-1] == "  streams: did not lower: LoweringError"


# ---------------------------------------------------------------------------
# Never fatal: inside another jit, a bound against the device's free memory.

def _nested_text(context, free, monkeypatch):
  """The scanned towers called in ``context`` on a pretend device with
  ``free`` bytes free, lowered for a GPU; their plan (a function of its
  own each time: the choice is kept per signature)."""
  monkeypatch.setattr(memory, "free_bytes", lambda device: free)
  fn, args, streams = compile_matrix.PROGRAMS["scan_towers"]()
  f = jaxstreams.jit(lambda *a: fn(*a), streams=streams)
  outer, outer_args = compile_matrix.in_context(f, context, args)
  lowered = outer.trace(*outer_args).lower(lowering_platforms=("cuda",))
  return lowered.as_text(), f.plan(*args)


def _loops(text):
  return text.count("stablehlo.while")


@pytest.mark.parametrize("context", ["jit", "grad", "vmap"])
def test_inside_another_jit_the_default_steps_aside_where_it_may_not_fit(
    context, monkeypatch):
  """The towers' bound is about a MiB: a device with a GiB free runs them
  as one loop; one with a MiB free runs jax.jit's program (two loops, or
  four under grad), and the plan says so."""
  roomy, plan = _nested_text(context, 2**30, monkeypatch)
  per_pass = 2 if context == "grad" else 1
  assert _loops(roomy) == per_pass
  assert "within 10% of the device's 1024.0 MiB free" in plan.gpu_reason
  tight, plan = _nested_text(context, 2**20, monkeypatch)
  assert _loops(tight) == 2 * per_pass
  assert "_xla_stream_annotation" not in tight
  assert ("more than 10% of the device's 1.0 MiB free: jax.jit's program "
          "instead") in plan.gpu_reason


def test_under_vmap_the_bound_counts_every_copy(monkeypatch):
  """Under jax.vmap over 2, twice the bound must fit in the device's share:
  a share that holds the bound 1.5 times steps aside, 2.5 times does not."""
  fn, args, streams = compile_matrix.PROGRAMS["scan_towers"]()
  f = jaxstreams.jit(fn, streams=streams)
  bound = memory.extra_bound(f._spec.partitioned(*args),
                             f._program(f._nested_way(), top_level=False))
  text, _ = _nested_text("vmap", int(bound / memory.NESTED_SHARE * 1.5),
                         monkeypatch)
  assert _loops(text) == 2
  text, _ = _nested_text("vmap", int(bound / memory.NESTED_SHARE * 2.5),
                         monkeypatch)
  assert _loops(text) == 1


def test_without_a_gpu_nothing_is_checked(monkeypatch):
  text, plan = _nested_text("jit", None, monkeypatch)
  assert _loops(text) == 1
  assert "not checked: no GPU here" in plan.gpu_reason


# ---------------------------------------------------------------------------
# Never fatal at top level, untimed: the default's own compile is read.

@pytest.mark.parametrize("free, way", [(2**30, "concurrent"), (1000, "inline")])
def test_untimed_the_default_runs_only_where_its_program_fits(
    untimed_gpu, monkeypatch, compiles, free, way):
  monkeypatch.setattr(memory, "free_bytes", lambda device: free)
  fn, args = tuned_towers(), towers_args()
  expected = jax.jit(fn)(*args)
  compiles.clear()
  f = jaxstreams.jit(fn, streams=3)
  assert_equal_results(f(*args), expected)
  plan = f.plan(*args)
  assert plan.gpu_lowering == way
  # The default's program was compiled once, its memory read from that
  # compile, and the call ran from it; jax.jit's program compiled too where
  # the default stepped aside.
  assert compiles.count("tuned_towers") == (1 if way == "concurrent" else 2)
  if way == "inline":
    assert re.search(r"'concurrent' needs [\d.]+ KiB on the device, 1000 B "
                     r"free: jax.jit's program instead", plan.gpu_reason)


def test_concurrent_graphs_are_not_the_default_where_only_loops_overlap(
    untimed_gpu):
  """Towers of while loops (never run as one): what can run side by side is
  loops, which XLA runs outside its CUDA graphs; CONCURRENT would buy
  nothing and cost memory."""
  fn, args, streams = compile_matrix.PROGRAMS["while_towers"]()
  plan = jaxstreams.jit(fn, streams=streams).plan(*args)
  assert plan.loops == () and plan.gpu_lowering == "inline"
  assert "CONCURRENT graphs would hold nothing side by side" in plan.gpu_reason
  towers = jaxstreams.jit(tuned_towers(), streams=3)
  assert towers.plan(*towers_args()).gpu_lowering == "concurrent"


# ---------------------------------------------------------------------------
# The bound holds: XLA's own figures for the nested program, against
# jax.jit's, compiled for an H100 without one.

def _needed_under_grad(fn, args):
  """What XLA says ``jax.grad`` of ``fn`` needs on an H100."""
  target = jaxstreams.gpu_target("h100")
  outer, args = compile_matrix.in_context(fn, "grad", args)
  return memory.footprint(outer.lower(*target.abstract(*args)).compile()).needed


@pytest.mark.parametrize("name", ["checkpointed_scan_towers", "four_branches"])
def test_the_bound_holds_under_a_gradient_taken_outside(name):
  """The tightest cases measured (docs/xla.md): a gradient taken outside
  two checkpointed scanned towers, and outside four stream calls (jax 0.12;
  before it, the nested way runs jax.jit's program for branches without
  loops)."""
  require_gpu_target()
  if name == "four_branches":   # tests/gpu_compile_programs.py's, half as wide
    fn, args, streams = four_branches, four_branches_args(64, 128), 4
  else:
    fn, args, streams = compile_matrix.PROGRAMS[name]()
  f = jaxstreams.jit(fn, streams=streams)
  program = f._program(f._nested_way(), top_level=False)
  bound = memory.extra_bound(f._spec.partitioned(*args), program)
  if name == "four_branches" and not _compat.XLA_SCHEDULES_STREAM_CALLS:
    # The nested way, 'loops', emits jax.jit's program: nothing to add.
    assert program == "loops" and bound == 0
    return
  extra = _needed_under_grad(f, args) - _needed_under_grad(fn, args)
  assert 0 < extra <= bound
