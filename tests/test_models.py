"""Models as users write them: ``benchmarks/workloads/``' dual encoders in
``flax.linen`` (``nn.scan``), ``flax.nnx`` (``nnx.vmap`` stacks run by
``nnx.scan``) and equinox (``eqx.filter_vmap`` stacks run by ``lax.scan``),
and a ``flax.linen`` multi-task model whose heads are scanned stacks, each
trained with optax's ``adamw``.

For each: called the way its library's users call jit (``jaxstreams.jit``
for a linen step, ``jaxstreams.nnx_jit`` for ``nnx.jit``,
``jaxstreams.filter_jit`` for ``eqx.filter_jit``), the results are bitwise
those of that library's jit on CPU; the plan runs the towers' loops as one
(with stream blocks, and found by ``spread=True`` without any); and what
an H100 would launch for it with jaxstreams' defaults (``xla_graphs``, a
deviceless compile) has the towers' layers in flight together.

What waits on loops of different lengths and on scans through wrappers
(#48 items 1 and 2, branch issue48-loops) is here as strict expected
failures: towers of unequal depth, a tower under ``nn.remat``
(``jax.checkpoint``) or ``nn.jit``. Widths are small: compile time grows
with width and the number of programs, not with depth.
"""

import functools

import equinox as eqx
import jax
import numpy as np
import pytest
from flax import nnx

import jaxstreams
from jaxstreams import _compat
import compile_matrix  # noqa: F401 - puts the checkout on sys.path (benchmarks)
from benchmarks.workloads import (common, equinox_dual_encoder,
                                  linen_dual_encoder, linen_multitask,
                                  nnx_dual_encoder)
from programs import require_gpu_target
from test_gpu_view import _on_two_streams, _tower_pairs, _view

KEY = jax.random.PRNGKey(0)
TOWERS = {linen_dual_encoder: 2, nnx_dual_encoder: 2, equinox_dual_encoder: 2,
          linen_multitask: 3}


@functools.cache
def _model(module, mode, **size):
  """(placed, plain, args, streams) of a workload at its quick size: its
  function with stream blocks, without, and its arguments. Made once, so
  that the tests share jax's and jaxstreams' traces and compiles."""
  size = dict(module.sizes(quick=True)[0], mode=mode, **size)
  streams = TOWERS[module] + 1
  make_fn, args = module.model(size, streams, KEY)
  return (make_fn(common.place_jaxstreams), make_fn(common.place_none), args,
          streams)


def _equal(actual, expected):
  actual, expected = jax.tree.leaves(actual), jax.tree.leaves(expected)
  assert len(actual) == len(expected)
  for a, e in zip(actual, expected):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _grouped(plan, towers):
  """The plan's loop groups that hold one loop of every tower."""
  return [g for g in plan.loops if len(g.regions) == towers
          and len({plan.regions[r].stream for r in g.regions}) == towers]


# ---------------------------------------------------------------------------
# Results, called the way each library's users call jit.

def test_a_linen_training_step_is_bitwise_jax_jits():
  placed, plain, args, streams = _model(linen_dual_encoder, "train")
  _equal(jaxstreams.jit(placed, streams=streams)(*args),
         jax.jit(plain)(*args))


def test_nnx_jit_updates_the_modules_as_nnx_jit_does():
  size = dict(nnx_dual_encoder.sizes(quick=True)[0])
  batch = linen_dual_encoder.inputs(size, KEY)
  theirs = nnx_dual_encoder.create(size, KEY)
  ours = nnx_dual_encoder.create(size, KEY)
  expected = nnx.jit(nnx_dual_encoder.train_step_for())(*theirs, *batch)
  step = jaxstreams.nnx_jit(
      nnx_dual_encoder.train_step_for(common.place_jaxstreams), streams=3)
  _equal(step(*ours, *batch), expected)
  _equal(nnx.state(ours), nnx.state(theirs))     # updated in place, alike
  assert _grouped(step.plan(*ours, *batch), 2)


def test_filter_jit_returns_what_eqx_filter_jit_does():
  size = dict(equinox_dual_encoder.sizes(quick=True)[0])
  batch = linen_dual_encoder.inputs(size, KEY)
  model, opt_state = equinox_dual_encoder.create(size, KEY)
  expected = eqx.filter_jit(equinox_dual_encoder.train_step_for())(
      model, opt_state, *batch)
  step = jaxstreams.filter_jit(
      equinox_dual_encoder.train_step_for(common.place_jaxstreams), streams=3)
  got = step(model, opt_state, *batch)
  _equal(got, expected)
  # The static half of the returned model came back with it.
  assert eqx.tree_equal(eqx.filter(got[1], eqx.is_array, inverse=True),
                        eqx.filter(expected[1], eqx.is_array, inverse=True))
  assert _grouped(step.plan(model, opt_state, *batch), 2)


def test_the_adapters_refuse_what_names_positions():
  for adapter in (jaxstreams.nnx_jit, jaxstreams.filter_jit):
    with pytest.raises(TypeError, match=r"does not take donate_argnums: it "
                       r"splits the arguments itself"):
      adapter(lambda m: m, streams=2, donate_argnums=0)


def test_nnx_jit_refuses_a_module_as_result():
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"returned a Linear; return arrays"):
    jaxstreams.nnx_jit(lambda m: m, streams=2)(model)


# ---------------------------------------------------------------------------
# The plan: stream blocks, and spreading without them.

MODELS = [linen_dual_encoder, nnx_dual_encoder, equinox_dual_encoder,
          linen_multitask]


@pytest.mark.parametrize("module", MODELS, ids=lambda m: m.NAME)
@pytest.mark.parametrize("mode", ["forward", "train"])
def test_the_towers_loops_run_as_one(module, mode):
  """Stream blocks: the forward pass's loops are one group, and in the
  training step the backward pass's (reversed) too, each tower's body on
  its stream."""
  placed, _, args, streams = _model(module, mode)
  plan = jaxstreams.jit(placed, streams=streams).plan(*args)
  groups = _grouped(plan, TOWERS[module])
  assert sorted(g.reverse for g in groups) == (
      [False] if mode == "forward" else [False, True]), str(plan)
  assert all(plan.regions[r].stream != 0 for g in groups for r in g.regions)


@pytest.mark.parametrize("module", MODELS, ids=lambda m: m.NAME)
@pytest.mark.parametrize("mode", ["forward", "train"])
def test_spreading_finds_the_towers_without_stream_blocks(module, mode):
  """No stream block at all: the cost model gives each tower's loop (a
  scan costs its trip count times its body) a stream of its own, and the
  loops are grouped; the results are still bitwise jax.jit's (checked
  on one model: on CPU every spread program runs in place)."""
  _, plain, args, streams = _model(module, mode)
  spread = jaxstreams.jit(plain, streams=streams, spread=True)
  plan = spread.plan(*args)
  groups = _grouped(plan, TOWERS[module])
  assert sorted(g.reverse for g in groups) == (
      [False] if mode == "forward" else [False, True]), str(plan)
  if mode == "forward" and module is linen_dual_encoder:
    _equal(spread(*args), jax.jit(plain)(*args))


# ---------------------------------------------------------------------------
# What an H100 launches (deviceless compiles).

@pytest.fixture(scope="module")
def gpu_target():
  require_gpu_target()


# jaxlib 0.10's memory scheduler runs each body's stream call of a
# transformer training step to its done before the next one's start (the
# suite's dual encoder, test_gpu_view.py, docs/xla.md).
_BODIES_IN_SEQUENCE = pytest.mark.xfail(
    _compat.jaxlib_version() < (0, 11), strict=True,
    reason="jaxlib 0.10 schedules a step's multi-result stream calls one "
           "after the other (docs/xla.md)")


def _assert_side_by_side(graphs, plan, towers, *, off_main=True):
  """Every group of the towers' loops is one loop in which each tower's
  body is in flight with another's (two towers: with each other; of three,
  jaxlib 0.12 keeps two bodies' calls in flight at a time: the first's
  done comes before the third's start), each pair on streams of their
  own."""
  groups = _grouped(plan, towers)
  assert groups, str(plan)
  together = set(graphs.parallel_regions())
  for g in groups:
    pairs = [(a, b) for i, a in enumerate(g.regions) for b in g.regions[i + 1:]
             if (a, b) in together]
    assert {r for p in pairs for r in p} == set(g.regions), graphs.summary()
    if off_main:
      assert all(_on_two_streams(graphs, p) for p in pairs), graphs.summary()


@pytest.mark.parametrize("module, mode, context", [
    pytest.param(linen_dual_encoder, "train", "top",
                 marks=_BODIES_IN_SEQUENCE),
    (linen_dual_encoder, "forward", "jit"),
    (nnx_dual_encoder, "forward", "top"),
    (equinox_dual_encoder, "forward", "top"),
    (linen_multitask, "forward", "top"),
], ids=lambda p: getattr(p, "NAME", p))
def test_the_towers_layers_are_in_flight_together(gpu_target, module, mode,
                                                  context):
  placed, _, args, streams = _model(module, mode)
  graphs, plan = _view(placed, args, streams, context=context)
  _assert_side_by_side(graphs, plan, TOWERS[module])


def test_spread_towers_are_in_flight_together(gpu_target):
  _, plain, args, streams = _model(linen_dual_encoder, "forward")
  graphs, plan = _view(plain, args, streams, spread=True)
  _assert_side_by_side(graphs, plan, 2, off_main=False)


# Waiting on #48 items 1 and 2 (branch issue48-loops): loops of different
# lengths, and scans inside jax.checkpoint / a nested jit.
_UNEQUAL = pytest.mark.xfail(
    strict=True, reason="loops of different lengths are not grouped yet "
                        "(#48 item 1, issue48-loops)")
_WRAPPED = pytest.mark.xfail(
    strict=True, reason="scans inside jax.checkpoint or a nested jit are not "
                        "grouped yet (#48 item 2, issue48-loops)")


@pytest.mark.parametrize("module, mode, size", [
    # Side by side since issue48-loops landed (0.10.2 and 0.12.0.1 seen).
    (linen_dual_encoder, "forward", dict(depths=(6, 3))),
    pytest.param(linen_dual_encoder, "train", dict(depths=(24, 12)),
                 marks=_UNEQUAL),
    pytest.param(nnx_dual_encoder, "train", dict(depths=(6, 3)),
                 marks=_UNEQUAL),
    pytest.param(equinox_dual_encoder, "forward", dict(depths=(24, 12)),
                 marks=_UNEQUAL),
    pytest.param(linen_dual_encoder, "train", dict(wrap="remat"),
                 marks=_WRAPPED),
    pytest.param(linen_dual_encoder, "forward", dict(wrap="jit"),
                 marks=_WRAPPED),
], ids=lambda p: getattr(p, "NAME", None) or (
    "-".join(map(str, p.values())) if isinstance(p, dict) else p))
def test_towers_as_large_models_write_them(gpu_target, module, mode, size):
  """Towers of unequal depth, a checkpointed tower, a jitted tower: the
  plan groups their loops, and an H100 has their layers in flight
  together. (The plan is checked first: it fails without compiling.)"""
  placed, plain, args, streams = _model(module, mode, **size)
  plan = jaxstreams.jit(placed, streams=streams).plan(*args)
  assert _grouped(plan, 2), str(plan)
  _equal(jaxstreams.jit(placed, streams=streams)(*args), jax.jit(plain)(*args))
  graphs, plan = _view(placed, args, streams)
  _assert_side_by_side(graphs, plan, 2)
