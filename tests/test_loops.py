"""Independent loops on different streams run as one loop, each body on its
stream (``jaxstreams.partition.loops``, ``jaxstreams.lower.loops``).

On CPU the results are bitwise those of ``jax.jit`` whatever the way; the
GPU program is read from the lowering for CUDA (no GPU needed). What XLA
compiles and launches from it is ``test_compile_matrix.py`` and
``test_gpu_view.py``'s, but for towers inside the wrappers users write
(nested jits, ``jax.checkpoint``, ``custom_vjp`` / ``custom_jvp``), whose
view is read here, beside their plan.
"""

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxstreams
from jaxstreams import _compat
from jaxstreams.partition.loops import MAX_LAYERS_PER_STEP, layout
from jaxstreams.tag.read import any_equation, expose_tags
from programs import random_inputs, require_gpu_target

import compile_matrix


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


def test_each_body_call_returns_one_value(args):
  """Each body's stream call returns its results as one value (one tuple,
  or one packed buffer on jaxlib 0.10): XLA:GPU, from jaxlib 0.11, would
  run each result of a call with several as a stream call of its own
  (tests/test_gpu_view.py)."""
  step = jax.value_and_grad(towers, argnums=(0, 1))
  text = _cuda_text(jaxstreams.jit(step, streams=3, gpu_lowering="loops"),
                    *args)
  annotated = [line for line in text.splitlines()
               if "call @" in line and "_xla_stream_annotation" in line]
  assert len(annotated) == 4   # two bodies, forward and backward
  assert all(re.search(r"\) -> (tuple|tensor)<", line) for line in annotated)


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

  def opposite_directions(w1, w2, x):
    with jaxstreams.stream(1):
      a = _scan(w1, x)
    with jaxstreams.stream(2):
      b = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w2,
                   reverse=True)[0]
    return (a + b).sum()

  def unrolled_whole(w1, w2, x):   # no loop left for XLA to run
    with jaxstreams.stream(1):
      a = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w1,
                   unroll=True)[0]
    with jaxstreams.stream(2):
      b = _scan(w2, x)
    return (a + b).sum()

  for fn in (dependent, same_stream, opposite_directions, unrolled_whole):
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


# ---------------------------------------------------------------------------
# Scans of different lengths.

@pytest.mark.parametrize("lengths, phases", [
    ((4, 4), [(4, (0, 1), (1, 1))]),
    ((24, 12), [(12, (0, 1), (2, 1))]),
    ((6, 3), [(3, (0, 1), (2, 1))]),
    ((24, 12, 6), [(6, (0, 1, 2), (4, 2, 1))]),
    ((6, 4), [(2, (0, 1), (3, 2))]),
    # No common divisor small enough: the shorter's length, then the rest.
    ((7, 3), [(3, (0, 1), (2, 1)), (1, (0,), (1,))]),
    ((24, 2), [(2, (0, 1), (4, 1)), (16, (0,), (1,))]),
    ((10, 9, 7), [(7, (0, 1, 2), (1, 1, 1)), (1, (0, 1), (3, 2))]),
])
def test_the_layout_of_scans_of_different_lengths(lengths, phases):
  laid = layout(lengths)
  assert [(p.steps, p.members, p.per_step) for p in laid] == phases
  # Every layer of every scan runs once, in order.
  for m, n in enumerate(lengths):
    spans = sorted(p.layers(p.members.index(m)) for p in laid
                   if m in p.members)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
  assert all(k <= MAX_LAYERS_PER_STEP for p in laid for k in p.per_step)


def _stacked_scan(ws, x, reverse=False):
  """A scan with stacked results and a carry: h -> tanh(h @ w)."""
  return lax.scan(lambda h, w: (jnp.tanh(h @ w), jnp.sum(h, axis=0)), x, ws,
                  reverse=reverse)


def mixed_towers(*ws_and_x):
  """One scan per stream, each of its own length, and work that needs
  them all."""
  *ws, x = ws_and_x
  outs = []
  for s, w in enumerate(ws):
    with jaxstreams.stream(s + 1):
      outs.append(_stacked_scan(w, x))
  return sum(jnp.sum(h * (i + 1)) + jnp.sum(y ** 2)
             for i, (h, y) in enumerate(outs))


def _mixed_args(lengths):
  ws = random_inputs(*[(n, 32, 32) for n in lengths])
  return [w * 0.2 for w in ws] + [random_inputs((8, 32), seed=1)[0]]


def _training_step(fn, count):
  return lambda *a: jax.value_and_grad(fn, argnums=tuple(range(count)))(*a)


@contextlib.contextmanager
def gpu_program_on_cpu():
  """Trace the GPU branch of each group (``lax.platform_dependent``'s
  default) so that XLA:CPU runs it: the program a GPU runs, its streams
  aside."""
  original = jax.lax.platform_dependent
  jax.lax.platform_dependent = lambda *args, cpu, default: default(*args)
  try:
    yield
  finally:
    jax.lax.platform_dependent = original


@pytest.mark.parametrize("lengths", [(24, 12), (7, 3, 2)])
def test_scans_of_different_lengths_run_as_one_loop(lengths):
  args = _mixed_args(lengths)
  plan = jaxstreams.jit(mixed_towers, streams=len(lengths) + 1).plan(*args)
  (group,) = plan.loops
  assert group.lengths == lengths and group.phases == layout(lengths)
  assert "taking R" in str(plan)
  step = _training_step(mixed_towers, len(lengths))
  forward, backward = sorted(
      jaxstreams.jit(step, streams=len(lengths) + 1).plan(*args).loops,
      key=lambda g: g.reverse)
  assert not forward.reverse and backward.reverse
  assert sorted(backward.lengths) == sorted(lengths)


@pytest.mark.parametrize("lengths, training", [
    ((24, 12), True), ((7, 3), False), ((10, 9, 7), True)])
def test_different_lengths_keep_jax_jits_results(lengths, training):
  """On CPU the program is jax.jit's (bitwise); the GPU's program, run on
  CPU, is too: each layer runs its operations in their order, whichever
  step of which loop runs it."""
  args = _mixed_args(lengths)
  fn = (_training_step(mixed_towers, len(lengths)) if training
        else mixed_towers)
  expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
  f = jaxstreams.jit(fn, streams=len(lengths) + 1, gpu_lowering="loops")
  for got in (f(*args), _gpu_branch(fn, len(lengths) + 1, args)):
    for g, e in zip(jax.tree_util.tree_leaves(got), expected):
      np.testing.assert_array_equal(g, e)


def _gpu_branch(fn, streams, args):
  with gpu_program_on_cpu():
    return jaxstreams.jit(fn, streams=streams, gpu_lowering="loops")(*args)


@pytest.mark.parametrize("lengths", [(10, 5), (7, 3)])
def test_the_gpu_program_never_copies_a_stack(lengths):
  """Each loop step reads its layers from the longer scan's whole stacked
  operands and writes its results into whole stacks, forward and in the
  gradient: nothing cuts a stack for a phase, reshapes it to several
  layers a step, or puts the phases' results together (each a copy of the
  stack: XLA cannot alias part of a buffer), where one length divides the
  other (10 and 5) and where layers are left over (7 and 3)."""
  longer = lengths[0]
  step = _training_step(mixed_towers, 2)
  text = _cuda_text(jaxstreams.jit(step, streams=3, gpu_lowering="loops"),
                    *_mixed_args(lengths))
  stack = re.compile(r"tensor<%dx32(x32)?xf32>" % longer)
  copies = [line for line in text.splitlines()
            if re.search(r"stablehlo\.(slice|reshape|concatenate) ", line)
            and stack.search(line)]
  assert not copies, copies
  assert "stablehlo.dynamic_update_slice" in text


# ---------------------------------------------------------------------------
# Scans inside the wrappers users write: nested jits, jax.checkpoint of a
# whole tower, custom_vjp and custom_jvp functions.

@jax.custom_jvp
def _custom_jvp_tower(ws, x):
  return compile_matrix._encoder_tower(ws, x)


@_custom_jvp_tower.defjvp
def _custom_jvp_tower_jvp(primals, tangents):
  return jax.jvp(compile_matrix._encoder_tower, primals, tangents)


_WRAPPED = {**compile_matrix.TOWER_WRAPS,
            "checkpoint_dots": jax.checkpoint(
                compile_matrix._encoder_tower,
                policy=jax.checkpoint_policies.dots_saveable),
            "custom_jvp": _custom_jvp_tower}


def _wrapped_towers(tower):
  def step(w1, w2, x):
    with jaxstreams.stream(1):
      a = tower(w1, x)
    with jaxstreams.stream(2):
      b = tower(w2, x)
    return jnp.sum(a * b)
  return step


def _wrapped_args():
  w1, w2 = random_inputs((4, 16, 16), (2, 16, 16))
  return w1 * 0.3, w2 * 0.3, random_inputs((4, 16), seed=1)[0]


# Each wrapper's towers (4 and 2 layers) in one program: what each must
# make of a training step, besides its forward group and its backward
# group, is a group of the recomputed forward scans (a checkpoint's, and a
# custom_vjp backward rule's that calls jax.vjp); custom_jvp and a jit
# recompute nothing.
_WRAPS = ("jit", "checkpoint", "checkpoint_dots", "custom_vjp", "custom_jvp")
_RECOMPUTING = ("checkpoint", "checkpoint_dots", "custom_vjp")


def _all_wrapped(params, x):
  total = 0.0
  for (w1, w2), wrap in zip(params, _WRAPS):
    total = total + _wrapped_towers(_WRAPPED[wrap])(w1, w2, x)
  return total


def _all_wrapped_args():
  ws = random_inputs(*[(4, 16, 16), (2, 16, 16)] * len(_WRAPS))
  params = [(ws[2 * i] * 0.3, ws[2 * i + 1] * 0.3)
            for i in range(len(_WRAPS))]
  return params, random_inputs((4, 16), seed=1)[0]


_ALL_WRAPPED = {"forward": _all_wrapped,
                "training": jax.value_and_grad(_all_wrapped)}
_WRAPPED_GROUPS = {
    "forward": [(False, (4, 2))] * len(_WRAPS),
    "training": ([(False, (4, 2))] * len(_WRAPS)
                 + [(True, (2, 4))] * len(_WRAPS)
                 + [(False, (2, 4))] * len(_RECOMPUTING))}


@functools.cache
def _all_wrapped_jit(kind):
  """The jaxstreams.jit function of the wrapped towers' program whose
  view is read (shared: its plan is made once). Never called at top level:
  on CPU that would settle CPU's way for its calls inside another jit."""
  return jaxstreams.jit(_ALL_WRAPPED[kind], streams=3)


@pytest.mark.parametrize("kind", ["forward", "training"])
def test_scans_inside_wrappers_are_grouped_as_if_written_plainly(kind):
  """Towers in a nested jax.jit, a jax.checkpoint (two policies), a
  custom_vjp and a custom_jvp function: forward, each pair of towers is
  one group; in a training step the forward and backward scans group,
  and so do the recomputations (_WRAPPED_GROUPS). Results bitwise
  jax.jit's."""
  args = _all_wrapped_args()
  f = jaxstreams.jit(_ALL_WRAPPED[kind], streams=3)
  plan = f.plan(*args)
  assert sorted((g.reverse, g.lengths) for g in plan.loops) \
      == sorted(_WRAPPED_GROUPS[kind]), str(plan)
  for got, want in zip(jax.tree_util.tree_leaves(f(*args)),
                       jax.tree_util.tree_leaves(
                           jax.jit(_ALL_WRAPPED[kind])(*args))):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind, context", [
    ("forward", "top"), ("training", "top"), ("training", "jit")])
def test_wrapped_towers_are_in_flight_together_on_an_h100(kind, context):
  """What XLA compiles for an H100 (without one) from the wrapped towers'
  program, at top level and called inside another jit: every group's
  towers run as one loop with both bodies in flight in every step, a
  checkpoint's recomputation included."""
  require_gpu_target()
  args = _all_wrapped_args()
  f = _all_wrapped_jit(kind)
  plan = f.plan(*args)
  outer = f if context == "top" else jax.jit(lambda *a: f(*a))
  graphs = jaxstreams.xla_graphs(
      outer.trace(*args).lower(lowering_platforms=("cuda",)), plan=plan)
  together = graphs.parallel_regions()
  apart = [g.regions for g in plan.loops
           if tuple(g.regions[:2]) not in together]
  assert not apart, str(graphs)
  assert len(graphs.loops) == len(_WRAPPED_GROUPS[kind]), str(graphs)


def _scan_outputs(closed, reverse):
  """The avals of the scans' results (``reverse`` ones), at any depth."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scan" and eqn.params["reverse"] == reverse:
        found.append(tuple(str(v.aval) for v in eqn.outvars))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(closed.jaxpr)
  return sorted(found)


@pytest.mark.parametrize("wrap", ["checkpoint", "checkpoint_dots"])
def test_a_checkpoint_saves_what_its_policy_says(wrap):
  """In a training step, the forward scans (grouped) save the residuals
  jax.checkpoint's policy saves under jax.jit, no more."""
  step = _training_step(_wrapped_towers(_WRAPPED[wrap]), 2)
  args = _wrapped_args()
  traced = jax.make_jaxpr(step)(*args)
  program = expose_tags(traced)
  assert all(e.primitive.name != "remat2" for e in program.jaxpr.eqns)
  exposed = jax.extend.core.ClosedJaxpr(program.jaxpr, program.consts)
  assert _scan_outputs(exposed, False) == _scan_outputs(traced, False)


def _scaled_vjp_tower():
  """A custom_vjp tower whose backward rule is not the derivative (three
  times it): differentiated, only the rule gives its result."""
  @jax.custom_vjp
  def tower(ws, x):
    return compile_matrix._encoder_tower(ws, x)

  def fwd(ws, x):
    return tower(ws, x), (ws, x)

  def bwd(residuals, cotangent):
    return jax.vjp(compile_matrix._encoder_tower, *residuals)[1](
        cotangent * 3.0)
  tower.defvjp(fwd, bwd)
  return tower


def _holds(closed, name) -> bool:
  return any_equation(closed.jaxpr.eqns, lambda e: e.primitive.name == name)


def test_differentiated_from_outside_each_wrapper_keeps_its_meaning():
  """jax.grad applied outside a jaxstreams.jit function whose towers are
  checkpointed or custom_vjp functions (taken apart to group their scans):
  the checkpoint still recomputes in the backward pass and the user's
  rule still gives the gradient, bitwise as under jax.jit."""
  args = _wrapped_args()

  def gradient(fn):
    return jax.jit(jax.grad(fn, argnums=(0, 1)))

  for tower, must_hold in ((_WRAPPED["checkpoint"], "remat2"),
                           (_scaled_vjp_tower(), None)):
    fn = _wrapped_towers(tower)
    js = jaxstreams.jit(fn, streams=3)
    assert js.plan(*args).loops
    outside = gradient(lambda *a: js(*a))
    expected = gradient(fn)(*args)
    for got, want in zip(outside(*args), expected):
      np.testing.assert_array_equal(got, want)
    if must_hold:
      assert _holds(jax.make_jaxpr(outside)(*args), must_hold)
  # The last tower's rule is not the derivative: its gradient is the rule's.
  plain = gradient(_wrapped_towers(compile_matrix._encoder_tower))(*args)
  np.testing.assert_allclose(expected[0], 3 * plain[0], rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------------
# A body that reads its incoming carry after writing the next one.

def _delta_scan(ws, x):
  """Each step's result reads the incoming carry and the next one (an
  increment): XLA 0.11 and 0.12 abort on it inside a stream call."""
  def step(c, w):
    c2 = jnp.tanh(c @ w)
    return c2, jnp.sum(c2 - c, axis=0)
  return lax.scan(step, x, ws)


def _body_of(fn, *args):
  (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).eqns
            if e.primitive.name == "scan"]
  num_consts, num_carry = _compat.scan_counts(eqn.params)
  return _compat.nested_jaxpr({"jaxpr": eqn.params["jaxpr"]}).jaxpr, \
      num_consts, num_carry


def test_which_bodies_read_their_carry_after_writing_it(args):
  """``carry_hazard``: found through a nested jit (XLA inlines it), and
  not where the reading comes before the writing or where one jitted
  function is called twice in a row (each call's values are its own)."""
  from jaxstreams.lower.limits import carry_hazard
  w, _, x = args

  def nested(ws, x):
    @jax.jit
    def layer(c, w):
      c2 = jnp.tanh(c @ w)
      return c2, jnp.sum(c2 - c, axis=0)
    return lax.scan(layer, x, ws)

  def twice(ws, x):
    layer = jax.jit(lambda c, w: jnp.tanh(c @ w))
    return lax.scan(lambda c, w: (layer(layer(c, w), w), jnp.sum(c)), x, ws)

  expected = _compat.jaxlib_version() >= (0, 11)
  for fn in (_delta_scan, nested):
    why = carry_hazard(*_body_of(fn, w, x))
    assert (why is not None) == expected, why
    if expected:
      assert "carry 0" in why and "linearizer" in why
  for fn in (_scan, twice):
    assert carry_hazard(*_body_of(fn, w, x)) is None


def _nested_delta_scan(ws, x):
  """``_delta_scan`` with its step a jitted function: the reading of the
  carry after the next one is written is inside one equation."""
  @jax.jit
  def step(c, w):
    c2 = jnp.tanh(c @ w)
    return c2, jnp.sum(c2 - c, axis=0)
  return lax.scan(step, x, ws)


def test_which_part_of_a_body_runs_after_its_call():
  """``carry_tail``: the readings of the carry after the next one is
  written and what depends on them; None where a carry would be written
  after the call or the reading is inside one nested jit."""
  from jaxstreams.lower.limits import carry_tail
  w, x = jnp.ones((4, 8, 8)), jnp.ones((2, 8))

  def feeds_carry(ws, x):   # the reading writes the next carry
    return lax.scan(lambda c, w: (jnp.tanh(c @ w) - c, None), x, ws)

  def chained(ws, x):
    def step(c, w):
      c2 = jnp.tanh(c @ w)
      d = c2 - c
      return c2, (jnp.sum(d * d), jnp.abs(c2))
    return lax.scan(step, x, ws)

  jaxpr, consts, carry = _body_of(chained, w, x)
  tail = carry_tail(jaxpr, consts, carry)
  assert [jaxpr.eqns[i].primitive.name for i in tail] == [
      "sub", "mul", "reduce_sum"]
  assert carry_tail(*_body_of(_nested_delta_scan, w, x)) is None
  assert carry_tail(*_body_of(feeds_carry, w, x)) is None


def _two_towers(scan):
  def towers(w1, w2, x):
    with jaxstreams.stream(1):
      a, da = scan(w1, x)
    with jaxstreams.stream(2):
      b, db = scan(w2, x)
    return jnp.sum(a * b) + jnp.sum(da) + jnp.sum(db)
  return towers


@pytest.mark.parametrize("lengths", [(4, 4), (8, 4)])
def test_a_body_that_reads_its_carry_after_writing_it_runs_beside_the_other(
    lengths):
  """Towers whose steps return an increment (reading the carry after the
  next one is written; XLA of jaxlib 0.11 and 0.12 aborts on that inside
  a stream call in a loop): there the increments run after each body's
  call, on the main stream, and the plan says so; the rest of the bodies
  is in flight together on every jax, and the GPU's program gives
  jax.jit's results (run on CPU, the deeper tower two layers a step too;
  bitwise on CPU, where the program is jax.jit's)."""
  require_gpu_target()
  towers = _two_towers(_delta_scan)
  args = _mixed_args(lengths)
  f = jaxstreams.jit(towers, streams=3)
  plan = f.plan(*args)
  (group,) = plan.loops
  split = _compat.jaxlib_version() >= (0, 11)
  assert set(plan.in_part) == (set(group.regions) if split else set()), (
      str(plan))
  assert not plan.in_place and plan.gpu_lowering == "loops_concurrent"
  assert ("part after the call" in str(plan)) == split, str(plan)
  # The decisions made before emission, in the plan: each body a call,
  # its increment after it where the jaxlib needs that.
  for region, body in zip(group.regions, group.bodies):
    assert body.startswith(f"R{region} body: a stream call on stream"), body
    assert ("then its equations" in body) == split, body
  expected = jax.jit(towers)(*args)
  np.testing.assert_array_equal(f(*args), expected)
  # XLA:CPU fuses the sums of the one loop's program in its own way.
  np.testing.assert_allclose(_gpu_branch(towers, 3, args), expected,
                             rtol=1e-5)
  graphs = jaxstreams.xla_graphs(
      f.trace(*args).lower(lowering_platforms=("cuda",)), plan=plan)
  assert graphs.parallel_regions() == (tuple(group.regions),), str(graphs)


def test_loops_whose_bodies_would_all_run_in_place_stay_apart(args):
  """The same towers with the reading inside one jitted step, which cannot
  be moved out of the call: on jaxlib 0.11 and 0.12 the one loop would run
  both bodies in place, one after the other, so the towers stay apart
  (each its own loop, as jax.jit runs them; the default does not pick the
  loops way for them) and the plan says why; on 0.10 they are one loop
  with the bodies in flight together. Bitwise jax.jit's on CPU."""
  require_gpu_target()
  towers = _two_towers(_nested_delta_scan)
  f = jaxstreams.jit(towers, streams=3)
  plan = f.plan(*args)
  apart = _compat.jaxlib_version() >= (0, 11)
  assert len(plan.loops) == (0 if apart else 1), str(plan)
  assert len(plan.loops_apart) == (1 if apart else 0), str(plan)
  text = str(plan)
  assert "(loop body)" not in text, text
  assert ("every body would run in place" in text
          and "reads its carry 0" in text) == apart, text
  assert (plan.gpu_lowering == "loops_concurrent") != apart, text
  np.testing.assert_array_equal(f(*args), jax.jit(towers)(*args))
  graphs = jaxstreams.xla_graphs(
      f.trace(*args).lower(lowering_platforms=("cuda",)), plan=plan)
  assert len(graphs.loops) == (2 if apart else 1), str(graphs)
  if not apart:
    assert graphs.parallel_regions() == (tuple(plan.loops[0].regions),), (
        str(graphs))


def test_one_loop_where_one_body_of_the_group_can_be_a_stream_call(args):
  """A tower whose body must run in place beside one whose body need not:
  the group stays one loop (the plain body on its stream in flight beside
  the other on the main stream), and the plan names the body in place
  on jaxlib 0.11 and 0.12. Bitwise jax.jit's on CPU."""
  require_gpu_target()

  def mixed(w1, w2, x):
    with jaxstreams.stream(1):
      a, da = _nested_delta_scan(w1, x)
    with jaxstreams.stream(2):
      b = _scan(w2, x)
    return jnp.sum(a * b) + jnp.sum(da)

  f = jaxstreams.jit(mixed, streams=3)
  plan = f.plan(*args)
  assert len(plan.loops) == 1 and not plan.loops_apart, str(plan)
  hazardous = _compat.jaxlib_version() >= (0, 11)
  assert len(plan.in_place) == (1 if hazardous else 0), str(plan)
  assert ("(loop body): an operation of it reads its carry 0" in str(plan)
          ) == hazardous
  assert plan.gpu_lowering == "loops_concurrent", str(plan)
  np.testing.assert_array_equal(f(*args), jax.jit(mixed)(*args))
  graphs = jaxstreams.xla_graphs(
      f.trace(*args).lower(lowering_platforms=("cuda",)), plan=plan)
  assert len(graphs.loops) == 1, str(graphs)
  assert graphs.parallel_regions() == (tuple(plan.loops[0].regions),), (
      str(graphs))
