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
deviceless compile, which also estimates the step's time) has the towers'
layers in flight together: the linen
dual encoder with towers of 4 and 4 and of 6 and 3 layers, forward and
training step, at top level and inside another jit; the nnx and equinox
ones through their adapters; the multi-task model; linen towers in
``nn.remat`` and in ``nn.jit``. The equinox towers in
``eqx.filter_checkpoint`` and in ``eqx.filter_jit``: their plan and
results.

Cheap on purpose (CI runs this on three jax): each model is built,
traced and planned once per module (``_linen_case``, ``_users_models``),
widths are the workloads' quick ones, every compile checks something no
other one does, and on CPU, where jaxstreams keeps jax.jit's program, one
program of each library is compared bitwise. Depth costs nothing at
compile time (a scan's body is compiled once): towers of 24 and 12 layers
compile the program 6 and 3 do (one loop, the deeper tower two layers a
step), whose layout ``test_loops.py`` pins.
"""

import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
import pytest
from flax import nnx

import jaxstreams
from benchmarks.workloads import (common, equinox_dual_encoder,
                                  linen_dual_encoder, linen_multitask,
                                  nnx_dual_encoder)
from programs import require_gpu_target
from test_gpu_view import _on_two_streams

KEY = jax.random.PRNGKey(0)
TOWERS = {linen_dual_encoder: 2, nnx_dual_encoder: 2, equinox_dual_encoder: 2,
          linen_multitask: 3}
LINEN = [linen_dual_encoder, linen_multitask]


class Case(NamedTuple):
  placed: Any      # jaxstreams.jit of the function with stream blocks
  plain: Any       # jax.jit of it without
  spread: Any      # jaxstreams.jit(spread=True) of it without
  args: tuple
  towers: int


@functools.cache
def _linen_case(module, mode, depths=None, wrap=None) -> Case:
  """A flax.linen workload at its quick size, made once per module (its
  forward pass on the training step's parameters) so that every test of
  it shares jax's and jaxstreams' traces, plans and compiles."""
  size = dict(module.sizes(quick=True)[0], mode="train")
  size.update({k: v for k, v in (("depths", depths), ("wrap", wrap))
               if v is not None})
  streams = TOWERS[module] + 1
  if mode == "forward":
    params, _, *batch = _linen_case(module, "train", depths, wrap).args
    args = (params, *batch)
  elif wrap is not None:    # a wrapped tower keeps the plain one's parameters
    args = _linen_case(module, "train", depths).args
  else:
    _, args = module.model(size, streams, KEY)
  make_fn = module.make_fn(dict(size, mode=mode), streams)
  return Case(jaxstreams.jit(make_fn(common.place_jaxstreams), streams=streams),
              jax.jit(make_fn(common.place_none)),
              jaxstreams.jit(make_fn(common.place_none), streams=streams,
                             spread=True),
              args, TOWERS[module])


@functools.cache
def _plan(module, mode, depths=None, wrap=None, spread=False):
  case = _linen_case(module, mode, depths, wrap)
  return (case.spread if spread else case.placed).plan(*case.args)


@functools.cache
def _users_models(module, depths):
  """Two alike (model, optimizer state) of the nnx or equinox dual encoder
  and a batch: one for the library's own jit, one for the adapter (nnx's
  are updated in place; equinox's are immutable, so one serves both)."""
  size = dict(module.sizes(quick=True)[0], depths=depths)
  theirs = module.create(size, KEY)
  ours = nnx.clone(theirs) if module is nnx_dual_encoder else theirs
  return theirs, ours, linen_dual_encoder.inputs(size, KEY)


ADAPTERS = {nnx_dual_encoder: jaxstreams.nnx_jit,
            equinox_dual_encoder: jaxstreams.filter_jit}
# Towers of 6 and 3 layers for nnx (the deeper one runs two layers a
# step), of 4 and 4 for equinox.
ADAPTED_DEPTHS = {nnx_dual_encoder: (6, 3), equinox_dual_encoder: (4, 4)}


def _users_step(module, place, **options):
  """The training step as the library's users write it, under its adapter."""
  return ADAPTERS[module](module.train_step_for(place), streams=3, **options)


def _equal(actual, expected):
  actual, expected = jax.tree.leaves(actual), jax.tree.leaves(expected)
  assert len(actual) == len(expected)
  for a, e in zip(actual, expected):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _grouped(plan, towers):
  """The plan's loop groups that hold one loop of every tower, each on a
  stream of its own."""
  return [g for g in plan.loops if len(g.regions) == towers
          and len({plan.regions[r].stream for r in g.regions}) == towers]


def _assert_towers_grouped(plan, towers, mode, *, off_main=True,
                           recomputed=False):
  """The forward pass's loops are one group, and in a training step the
  backward pass's (reversed) too, and with ``recomputed`` (checkpointed
  towers) the backward pass's recomputation of the forward loops; with
  stream blocks, off the main stream."""
  groups = _grouped(plan, towers)
  expected = ([False] if mode == "forward"
              else [False, False, True] if recomputed else [False, True])
  assert sorted(g.reverse for g in groups) == expected, str(plan)
  if off_main:
    assert all(plan.regions[r].stream != 0 for g in groups for r in g.regions)
  return groups


# ---------------------------------------------------------------------------
# Results (bitwise jax.jit's on CPU), called the way each library's users
# call jit. On CPU jaxstreams keeps jax.jit's program, so one program of
# each style is checked.

def test_a_linen_dual_encoder_is_bitwise_jax_jits():
  case = _linen_case(linen_dual_encoder, "forward", (6, 3))
  _equal(case.placed(*case.args), case.plain(*case.args))


def test_a_spread_program_is_bitwise_jax_jits():
  case = _linen_case(linen_dual_encoder, "forward", (6, 3))
  _equal(case.spread(*case.args), case.plain(*case.args))


def test_nnx_jit_updates_the_modules_as_nnx_jit_does():
  theirs, ours, batch = _users_models(nnx_dual_encoder, (6, 3))
  expected = nnx.jit(nnx_dual_encoder.train_step_for())(*theirs, *batch)
  step = _users_step(nnx_dual_encoder, common.place_jaxstreams)
  _assert_towers_grouped(step.plan(*ours, *batch), 2, "train")
  _equal(step(*ours, *batch), expected)
  _equal(nnx.state(ours), nnx.state(theirs))     # updated in place, alike


def test_filter_jit_returns_what_eqx_filter_jit_does():
  """The training step's plan; a call that returns the model with its
  embeddings (the static half of a result comes back too; nnx_jit's test
  above compares a whole training step)."""
  _, (model, opt_state), batch = _users_models(equinox_dual_encoder, (4, 4))
  step = _users_step(equinox_dual_encoder, common.place_jaxstreams)
  _assert_towers_grouped(step.plan(model, opt_state, *batch), 2, "train")

  def embed(place):
    return lambda m, p, t: (m(p, t, place, 3), m)
  expected = eqx.filter_jit(embed(common.place_none))(model, *batch)
  got = jaxstreams.filter_jit(embed(common.place_jaxstreams), streams=3)(
      model, *batch)
  _equal(got, expected)
  assert eqx.tree_equal(eqx.filter(got[1], eqx.is_array, inverse=True),
                        eqx.filter(expected[1], eqx.is_array, inverse=True))


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
# The plan of each training step: its forward loops and its backward loops,
# with stream blocks, and spread without them.

@pytest.mark.parametrize("module", LINEN, ids=lambda m: m.NAME)
def test_the_linen_towers_loops_run_as_one(module):
  _assert_towers_grouped(_plan(module, "train", (4, 4) if module is
                               linen_dual_encoder else None),
                         TOWERS[module], "train")


@pytest.mark.parametrize("module", LINEN, ids=lambda m: m.NAME)
def test_spreading_finds_the_linen_towers_without_stream_blocks(module):
  """No stream block at all: the cost model gives each tower's loop (a
  scan costs its trip count times its body) a stream of its own, and the
  loops are grouped."""
  plan = _plan(module, "train", (4, 4) if module is linen_dual_encoder
               else None, spread=True)
  _assert_towers_grouped(plan, TOWERS[module], "train", off_main=False)


@pytest.mark.parametrize("module", list(ADAPTERS), ids=lambda m: m.NAME)
def test_spreading_finds_the_towers_through_the_adapters(module):
  _, ours, batch = _users_models(module, ADAPTED_DEPTHS[module])
  step = _users_step(module, common.place_none, spread=True)
  _assert_towers_grouped(step.plan(*ours, *batch), 2, "train",
                         off_main=False)


# ---------------------------------------------------------------------------
# What an H100 launches (deviceless compiles).

@pytest.fixture(scope="module")
def gpu_target():
  require_gpu_target()


def _view(jitted, args, plan, context):
  """What an H100 launches for ``jitted`` called at top level or inside
  another jit."""
  outer = jitted if context == "top" else jax.jit(lambda *a: jitted(*a))
  lowered = outer.trace(*args).lower(lowering_platforms=("cuda",))
  return jaxstreams.xla_graphs(lowered, plan=plan)


def _assert_side_by_side(graphs, plan, towers, mode, *, off_main=True,
                         recomputed=False):
  """Every group of the towers' loops (forward, and backward in a training
  step) is one loop in which each tower's body is in flight with another's
  (two towers: with each other; of three, jaxlib 0.12 keeps two bodies'
  calls in flight at a time: the first's done comes before the third's
  start), each pair on streams of their own. The view weighs the step in
  time too: its estimate (device path, host launch time) is in its
  summary."""
  estimate = graphs.estimate
  assert 0 < estimate.device <= estimate.step, estimate
  assert 0 < estimate.host <= estimate.step, estimate
  assert str(estimate) in graphs.summary()
  groups = _assert_towers_grouped(plan, towers, mode, recomputed=recomputed)
  together = set(graphs.parallel_regions())
  for g in groups:
    pairs = [(a, b) for i, a in enumerate(g.regions) for b in g.regions[i + 1:]
             if (a, b) in together]
    assert {r for p in pairs for r in p} == set(g.regions), graphs.summary()
    if off_main:
      assert all(_on_two_streams(graphs, p) for p in pairs), graphs.summary()


@pytest.mark.parametrize("depths, mode, context", [
    ((4, 4), "train", "top"),
    ((4, 4), "forward", "jit"),
    ((6, 3), "forward", "top"),
    ((6, 3), "train", "jit"),
], ids=lambda p: "-".join(map(str, p)) if isinstance(p, tuple) else p)
def test_the_linen_towers_layers_are_in_flight_together(gpu_target, depths,
                                                        mode, context):
  """Towers of 4 and 4 and of 6 and 3 layers (one loop of three steps, the
  deeper tower two layers a step), forward and training step, at top level
  and inside another jit. The plan is checked first: it fails without
  compiling."""
  plan = _plan(linen_dual_encoder, mode, depths)
  _assert_towers_grouped(plan, 2, mode)
  case = _linen_case(linen_dual_encoder, mode, depths)
  _assert_side_by_side(_view(case.placed, case.args, plan, context), plan, 2,
                       mode)


@pytest.mark.parametrize("module", list(ADAPTERS), ids=lambda m: m.NAME)
def test_the_adapters_towers_are_in_flight_together(gpu_target, module):
  """The forward pass under nnx_jit or filter_jit, as its users call it."""
  _, (model, _), batch = _users_models(module, ADAPTED_DEPTHS[module])
  forward = ADAPTERS[module](
      lambda m, p, t: m(p, t, common.place_jaxstreams, 3), streams=3)
  args = (model, *batch)
  plan = forward.plan(*args)
  _assert_side_by_side(_view(forward, args, plan, "top"), plan, 2, "forward")


def test_the_multitask_heads_are_in_flight_together(gpu_target):
  case = _linen_case(linen_multitask, "forward")
  plan = _plan(linen_multitask, "forward")
  _assert_side_by_side(_view(case.placed, case.args, plan, "top"), plan, 3,
                       "forward")


@pytest.mark.parametrize("wrap, mode", [("remat", "train"), ("jit", "forward")])
def test_wrapped_towers_layers_are_in_flight_together(gpu_target, wrap, mode):
  """Each tower wrapped whole: in nn.remat (jax.checkpoint; in a training
  step the backward pass recomputes the forward loops, a third group, in
  flight together too) or in nn.jit."""
  recomputed = wrap == "remat" and mode == "train"
  plan = _plan(linen_dual_encoder, mode, (4, 4), wrap)
  _assert_towers_grouped(plan, 2, mode, recomputed=recomputed)
  case = _linen_case(linen_dual_encoder, mode, (4, 4), wrap)
  _equal(case.placed(*case.args), case.plain(*case.args))
  _assert_side_by_side(_view(case.placed, case.args, plan, "top"), plan, 2,
                       mode, recomputed=recomputed)


@pytest.mark.parametrize("wrap", ["checkpoint", "jit"])
def test_equinox_wrapped_towers_loops_run_as_one(wrap):
  """Each tower in ``eqx.filter_checkpoint`` or ``eqx.filter_jit``, the
  training step under filter_jit: the forward loops and the backward loops
  each run as one (and a checkpointed tower's recomputation in the
  backward pass too); the results are bitwise eqx.filter_jit's."""
  module = equinox_dual_encoder
  size = dict(module.sizes(quick=True)[0], depths=(4, 4), wrap=wrap)
  model, opt_state = module.create(size, KEY)
  args = (model, opt_state, *linen_dual_encoder.inputs(size, KEY))
  step = _users_step(module, common.place_jaxstreams)
  _assert_towers_grouped(step.plan(*args), 2, "train",
                         recomputed=wrap == "checkpoint")
  expected = eqx.filter_jit(module.train_step_for())(*args)
  _equal(eqx.filter(step(*args), eqx.is_array),
         eqx.filter(expected, eqx.is_array))
