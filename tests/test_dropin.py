"""jaxstreams.jit as a drop-in for jax.jit (issue 16): each behaviour is
checked side by side with jax.jit in the same test."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from jaxstreams import _compat
from programs import (LOWERINGS, TRACES, assert_equal_results, cuda_text,
                      jax_events, random_inputs, two_towers)

# These read the GPU program's stream calls (or compare programs that have
# them): jaxstreams.jit functions are made with the 'streams' lowering.
pytestmark = pytest.mark.usefixtures("stream_calls")


def off_main_region(c):
  """The issue's program: a region on stream 1 whose output feeds a product
  of two primals on the main stream."""
  with jaxstreams.stream(1):
    b = jnp.sum(jnp.sin(c))
  return jnp.sin(c * b)


def untagged_towers(x, w1, w2):
  """Independent work with no stream() block: spread=True splits it."""
  a = jnp.tanh(x @ w1) @ w1
  b = jax.nn.relu(x @ w2) @ w2
  return (a * b).sum() * jnp.cos(x).sum()


def _loss_of(f):
  return lambda *a: jax.checkpoint(f)(*a).sum()


def test_grad_of_checkpoint_with_an_off_main_region():
  c = jnp.linspace(0.1, 1.0, 4)
  ours = jaxstreams.jit(off_main_region, streams=2)
  theirs = jax.jit(off_main_region)
  assert_equal_results(jax.grad(_loss_of(ours))(c),
                       jax.grad(_loss_of(theirs))(c))
  assert_equal_results(jax.jit(jax.grad(_loss_of(ours)))(c),
                       jax.jit(jax.grad(_loss_of(theirs)))(c))
  # The regions are still annotated calls in the GPU program, the gradient's
  # included.
  text = cuda_text(jax.jit(jax.grad(_loss_of(ours))), c)
  assert text.count('_xla_stream_annotation = "1"') >= 2
  assert 'inlineable = "false"' in text


def test_grad_of_checkpoint_with_spread_placement():
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  ours = jaxstreams.jit(untagged_towers, streams=3, spread=True)
  assert any(r.stream != 0 for r in ours.plan(x, w1, w2).regions), \
      "spread=True should split this program, or the test checks nothing"
  theirs = jax.jit(untagged_towers)
  assert_equal_results(
      jax.jit(jax.grad(_loss_of(ours), (1, 2)))(x, w1, w2),
      jax.jit(jax.grad(_loss_of(theirs), (1, 2)))(x, w1, w2))
  # x's cotangent sums the two towers' contributions, and the plan emits the
  # towers in another order than the source: equal to rounding, as without
  # jax.checkpoint (a README sharp edge).
  np.testing.assert_allclose(jax.jit(jax.grad(_loss_of(ours)))(x, w1, w2),
                             jax.jit(jax.grad(_loss_of(theirs)))(x, w1, w2),
                             rtol=1e-5)


@pytest.mark.parametrize("spread", [False, True])
def test_vmap_linearize_and_scan_over_planned_functions(spread):
  c = jnp.linspace(0.1, 1.0, 4)
  ours = jaxstreams.jit(off_main_region, streams=2, spread=spread)
  theirs = jax.jit(off_main_region)
  cs = jnp.stack([c, c * 2, c + 1])
  assert_equal_results(jax.jit(jax.vmap(ours))(cs),
                       jax.jit(jax.vmap(theirs))(cs))
  assert_equal_results(jax.jit(jax.vmap(jax.grad(_loss_of(ours))))(cs),
                       jax.jit(jax.vmap(jax.grad(_loss_of(theirs))))(cs))

  def linearized(f):
    return jax.jit(lambda c, t: jax.linearize(jax.checkpoint(f), c)[1](t))
  assert_equal_results(linearized(ours)(c, c * 3), linearized(theirs)(c, c * 3))

  def scanned(f):
    def loss(c):
      def body(carry, _):
        return jax.checkpoint(f)(carry), carry.sum()
      final, sums = jax.lax.scan(body, c, None, length=3)
      return final.sum() + sums.sum()
    return jax.jit(jax.grad(loss))
  assert_equal_results(scanned(ours)(c), scanned(theirs)(c))


def test_importing_jaxstreams_changes_no_jax_rule():
  """The region rules are installed by the first region emitted as a stream
  call, not as a side effect of ``import jaxstreams`` (nor by a program
  without regions, nor by one lowered inline, the default)."""
  code = (
      "import jax, jaxstreams\n"
      "from jaxstreams.lower import calls\n"
      "assert not calls._region_rules_installed\n"
      "jaxstreams.jit(lambda x: x * 2, streams=2)(1.0)\n"
      "assert not calls._region_rules_installed\n"
      "def f(x):\n"
      "  with jaxstreams.stream(1):\n"
      "    y = x * 2\n"
      "  return y + 1\n"
      "assert jaxstreams.jit(f, streams=2)(1.0) == 3.0\n"
      "assert not calls._region_rules_installed\n"
      "jaxstreams.config.update('jaxstreams_gpu_lowering', 'streams')\n"
      "assert jaxstreams.jit(f, streams=2)(1.0) == 3.0\n"
      "assert calls._region_rules_installed\n"
      "print('ok')\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "ok"


def _counting(counter):
  def counted(y):
    counter.append(1)
    with jaxstreams.stream(1):
      a = jnp.sin(y)
    return a * y
  return counted


@pytest.mark.parametrize("streams", [2, None])
def test_one_trace_for_many_jit_objects_of_one_function(streams, monkeypatch):
  """``jax.jit(f)(x)`` in a loop traces once; so does jaxstreams.jit."""
  monkeypatch.setattr(jaxstreams.config, "read", _streams_option(2))
  y = jnp.arange(4.0)
  ours_traces, theirs_traces = [], []
  ours_f, theirs_f = _counting(ours_traces), _counting(theirs_traces)
  for _ in range(4):
    ours = jaxstreams.jit(ours_f, streams=streams)(y)
    theirs = jax.jit(theirs_f)(y)
  assert_equal_results(ours, theirs)
  assert len(ours_traces) == len(theirs_traces) == 1
  # Other options are another program.
  jaxstreams.jit(ours_f, streams=3)(y)
  jaxstreams.jit(ours_f, streams=2, spread=True)(y)
  assert len(ours_traces) == 3


@pytest.mark.parametrize("spread", [False, True])
def test_jaxs_own_trace_and_lowering_counts_are_jax_jits(spread):
  """jax counts one trace and one lowering for a call, none more for
  ``lower``/``trace``/``eval_shape`` with the same arguments, and one of
  each for a jit around it: as for ``jax.jit``. (With the ``streams``
  lowering jax also traces each region's call, as it would a user's own
  ``compute_on``.)"""
  args = random_inputs((8, 16), (16, 16), (16, 16))

  def counts(make):
    def fun(*a):          # a new function: nothing cached yet
      return two_towers(*a)
    f = make(fun)
    found = []
    with jax_events(TRACES) as traces, jax_events(LOWERINGS) as lowerings:
      f(*args)
      found.append((traces(), lowerings()))
      f.lower(*args), f.trace(*args), f.eval_shape(*args)
      found.append((traces(), lowerings()))
      jax.jit(lambda *a: f(*a))(*args)
      found.append((traces(), lowerings()))
    return found

  counts(jax.jit)   # jax's own helpers (jnp functions) traced once
  ours = counts(lambda f: jaxstreams.jit(f, streams=3, spread=spread,
                                         gpu_lowering="default"))
  assert ours == counts(jax.jit) == [(1, 1), (1, 1), (2, 2)]


@pytest.mark.parametrize("lowering", ["default", "streams"])
@pytest.mark.parametrize("nested_first", [True, False])
def test_a_function_shares_its_trace_between_contexts_as_jax_jits(
    lowering, nested_first):
  """A function called as a scan's body inside another jit and at top level
  (either first) is traced once, as under ``jax.jit``
  (jax's ``test_lowering_cache_hit_with_closed_over_constants_scan``): its
  plan has nothing off the main stream, so the program a GPU runs it
  inside another jit is ``jax.jit``'s, the top-level one's."""
  constant = np.arange(8)

  def counts(make):
    body = make(lambda carry, x: (carry + constant, None))
    outer = jax.jit(lambda: jax.lax.scan(body, np.zeros_like(constant),
                                         np.ones((8,), np.float32)))
    top = lambda: body(constant, np.float32(1))
    calls = [outer, top] if nested_first else [top, outer]
    found = []
    with jax_events(TRACES) as traces, jax_events(LOWERINGS) as lowerings:
      for call in calls + calls:
        call()
        found.append((traces(), lowerings()))
    return [(t - found[0][0], l - found[0][1]) for t, l in found]

  counts(jax.jit)   # jax's own helpers traced once
  ours = counts(lambda f: jaxstreams.jit(f, streams=4, spread=True,
                                         gpu_lowering=lowering))
  assert ours == counts(jax.jit)


def test_a_nested_call_of_a_multi_stream_plan_still_gets_the_gpu_program():
  """Only a plan that the nested way emits as ``jax.jit``'s program shares
  the top-level trace: one with stream calls (jax 0.12) or loops to run as
  one gets the nested way's own program inside another jit, the program a
  GPU runs there."""
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  stacked = random_inputs((3, 16, 16), (3, 16, 16), seed=1)
  inline = jaxstreams.lower.gpu.WAYS["inline"]
  cases = [(on_main, (x, w1, w2), True),
           (two_towers, (x, w1, w2), not _compat.XLA_SCHEDULES_STREAM_CALLS),
           (scan_towers, (x, *stacked), False)]
  for fun, args, shared in cases:
    f = jaxstreams.jit(fun, streams=3, gpu_lowering="default")
    nested = jax.jit(lambda *a: f(*a)).trace(*args).jaxpr
    (call,) = [e for e in nested.eqns if e.primitive.name in ("pjit", "jit")]
    assert (f._nested_jit_for(args, {}) is f._jit(inline, top_level=False)
            ) is shared, fun.__name__
    inner = str(call.params["jaxpr"])
    assert (inner == str(jax.make_jaxpr(fun)(*args).jaxpr)) is shared, (
        fun.__name__)


def on_main(x, w1, w2):
  return jnp.tanh(x @ w1).sum() + (x @ w2).sum()


def scan_towers(x, ws1, ws2):
  layers = lambda ws: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None),
                                   x, ws)[0]
  with jaxstreams.stream(1):
    a = layers(ws1)
  with jaxstreams.stream(2):
    b = layers(ws2)
  return (a * b).sum()


def _streams_option(value):
  real_read = jaxstreams.config.read
  return lambda name: value if name == "jaxstreams_streams" else real_read(name)


def _closure_over_an_array():
  w = jnp.arange(4.0)

  def scaled(x):
    with jaxstreams.stream(1):
      y = x * w
    return y + 1
  return scaled


@pytest.mark.parametrize("make_jit", [
    lambda f: jax.jit(f),
    lambda f: jaxstreams.jit(f, streams=2),
    lambda f: jaxstreams.jit(f, streams=2, spread=True),
], ids=["jax.jit", "jaxstreams.jit", "jaxstreams.jit-spread"])
def test_dropped_function_is_freed_without_gc(make_jit):
  """No reference cycle keeps the user's function (and its closure) alive
  once the user drops it and the jit object: freed by reference counting,
  with the cyclic collector paused."""
  import gc
  import weakref
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    fun = _closure_over_an_array()
    ref = weakref.ref(fun)
    jitted = make_jit(fun)
    assert_equal_results(jitted(jnp.ones(4)), jnp.arange(4.0) + 1)
    del fun, jitted
    assert ref() is None
  finally:
    if was_enabled:
      gc.enable()


def test_names_follow_the_users_function():
  def two_streams_step(x):
    with jaxstreams.stream(1):
      y = jnp.sin(x)
    return y * x
  x = jnp.ones(4)
  ours = jaxstreams.jit(two_streams_step, streams=2)
  theirs = jax.jit(two_streams_step)
  first_line = lambda f: f.lower(x).as_text().splitlines()[0]
  assert first_line(ours).split()[1] == first_line(theirs).split()[1] \
      == "@jit_two_streams_step"
  assert ours.__name__ == theirs.__name__ == "two_streams_step"
  assert ours.__qualname__ == theirs.__qualname__


def _generator(x):
  yield x


class _WithStaticMethod:
  @staticmethod
  def scale(x, n):
    return x * n


@pytest.mark.parametrize("fun, kwargs", [
    (3, {}),
    (_generator, {}),
    (_WithStaticMethod.__dict__["scale"], {}),
    (_WithStaticMethod.scale, {"static_argnums": 5}),
], ids=["not-callable", "generator", "staticmethod", "static_argnums"])
def test_bad_functions_get_jax_jits_errors(fun, kwargs):
  with pytest.raises((TypeError, ValueError)) as theirs:
    jax.jit(fun, **kwargs)
  for streams in (2, None):
    with pytest.raises((TypeError, ValueError)) as ours:
      jaxstreams.jit(fun, streams=streams, **kwargs)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value) == str(theirs.value)


def test_disable_jit_runs_the_function_as_python():
  """Under jax.disable_jit() Python control flow on values works, and
  stream() blocks do nothing."""
  def branchy(x):
    with jaxstreams.stream(1):
      y = jnp.sin(x)
    if y.sum() > 0:   # a concrete value only without jit
      return y
    return -y
  x = jnp.ones(3)
  with jax.disable_jit():
    theirs = jax.jit(branchy)(x)
    ours = jaxstreams.jit(branchy, streams=2)(x)
    ours_from_option = jaxstreams.jit(branchy)(x)
  assert_equal_results(ours, theirs)
  assert_equal_results(ours_from_option, theirs)
  with pytest.raises(jax.errors.TracerBoolConversionError):
    jax.jit(branchy)(x)
  with pytest.raises(jax.errors.TracerBoolConversionError):
    jaxstreams.jit(branchy, streams=2)(x)


def test_tracebacks_hide_jaxstreams_frames_as_jax_hides_its_own():
  import traceback

  def raises(x):
    with jaxstreams.stream(1):
      jnp.sin(x)
    raise ValueError("from the user's function")

  def frames(jitted):
    with pytest.raises(ValueError) as info:
      jitted(jnp.ones(3))
    return [f.filename for f in traceback.extract_tb(info.value.__traceback__)]

  theirs = frames(jax.jit(raises))
  ours = frames(jaxstreams.jit(raises, streams=2))
  assert ours == theirs == [__file__, __file__]


def test_equal_bound_methods_outlive_each_other():
  """Bound methods made twice are equal but distinct; dropping the first
  jit object must leave the second working."""
  class Model:
    def __init__(self):
      self.w = 3.0

    def apply(self, x):
      with jaxstreams.stream(1):
        y = x * self.w
      return y + 1

  model = Model()
  first = jaxstreams.jit(model.apply, streams=2)
  second = jaxstreams.jit(model.apply, streams=2)
  x = jnp.arange(3.0)
  assert_equal_results(first(x), jax.jit(model.apply)(x))
  del first
  import gc
  gc.collect()
  longer = jnp.arange(5.0)   # new shapes: the second one traces again
  assert_equal_results(second(longer), jax.jit(model.apply)(longer))


def _branch_on_a_weight(x, params, *, scale):
  if params["w"].sum() > 0:   # a traced value: no Python bool
    return x * scale
  return x


def _length_from_a_value(x, n):
  return jnp.zeros(int(n)) + x   # a traced value: no Python int


@pytest.mark.parametrize("fun, args, kwargs, jit_kwargs, error, named", [
    (_branch_on_a_weight, (jnp.ones(3), {"w": jnp.ones(3)}), {"scale": 2.0},
     {"static_argnames": "scale"}, jax.errors.TracerBoolConversionError,
     "params['w']"),
    (_length_from_a_value, (1.0, jnp.array(3)), {}, {"static_argnums": 0},
     jax.errors.ConcretizationTypeError, "argument n"),
], ids=["bool-of-tracer", "int-of-tracer"])
def test_tracing_errors_name_the_users_function_and_argument(
    fun, args, kwargs, jit_kwargs, error, named):
  """jax's tracing errors name the user's function (name, file and line) and
  the argument the value came from, as jax.jit's do, not a jaxstreams
  wrapper and its positional inputs."""
  with pytest.raises(error) as theirs:
    jax.jit(fun, **jit_kwargs)(*args, **kwargs)
  where = (f"the function {fun.__name__} at {__file__}:"
           f"{fun.__code__.co_firstlineno}")
  assert where in str(theirs.value) and named in str(theirs.value)
  for streams in (2, None):
    with pytest.raises(error) as ours:
      jaxstreams.jit(fun, streams=streams, **jit_kwargs)(*args, **kwargs)
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(error) as planned:
      jaxstreams.plan(fun, streams=2, **jit_kwargs)(*args, **kwargs)
    assert where in str(planned.value) and named in str(planned.value)


def _returns_a_name(x):
  return {"y": x, "name": "not an array"}


def test_an_output_that_is_no_jax_type_is_named_as_jax_jit_names_it():
  with pytest.raises(TypeError) as theirs:
    jax.jit(_returns_a_name)(1.0)
  assert "returned a value of type" in str(theirs.value)
  assert "['name']" in str(theirs.value)
  with pytest.raises(TypeError) as ours:
    jaxstreams.jit(_returns_a_name, streams=2)(1.0)
  assert str(ours.value) == str(theirs.value)


def _divides_in_a_region(x, y):
  with jaxstreams.stream(1):
    z = x / y
  return z + 1


@pytest.mark.parametrize("nan_in", ["region", "main stream"])
def test_debug_nans_names_the_primitive_as_jax_jit_does(nan_in, monkeypatch):
  """Under ``jax_debug_nans`` a compiled call that makes a NaN is run again
  op by op, as if the jit were removed, and the error names the primitive
  that made it: for a NaN made inside a stream() block too."""
  monkeypatch.setattr(jaxstreams.config, "read", _streams_option(2))
  fun = _divides_in_a_region if nan_in == "region" else (lambda x, y: x / y)
  zero = jnp.zeros(())

  def message(jitted):
    with jax.debug_nans(True):
      with pytest.raises(FloatingPointError) as info:
        jitted(zero, zero).block_until_ready()
    return str(info.value)

  theirs = message(jax.jit(fun))
  assert "invalid value (nan) encountered in div" in theirs
  for streams in (2, None):
    assert message(jaxstreams.jit(fun, streams=streams, spread=True)) == theirs
  # Without the option the same function runs and returns its NaN.
  assert np.isnan(jaxstreams.jit(fun, streams=2)(zero, zero))


def test_a_function_without_weak_references_fails_at_its_call_as_with_jax_jit():
  class CallableWithSlots:
    __slots__ = []

    def __call__(self, x):
      return x + 1

  def call_error(jitted):
    with pytest.raises(TypeError) as info:
      jitted(3)
    return str(info.value)

  theirs = call_error(jax.jit(CallableWithSlots()))
  assert "cannot create weak reference" in theirs
  assert call_error(jaxstreams.jit(CallableWithSlots(), streams=2)) == theirs
  assert call_error(jaxstreams.jit(CallableWithSlots())) == theirs


def test_repr_getstate_and_cache_size_are_jax_jits():
  """repr, ``__getstate__`` (the function's name) and ``_cache_size`` as
  jax.jit's; a repr never fails, even for a callable whose repr raises."""
  class BadRepr:
    def __call__(self, x):
      return x

    def __repr__(self):
      raise ValueError("invalid repr")

  for fun in (BadRepr(), _divides_in_a_region,
              functools.partial(_divides_in_a_region)):
    ours, theirs = jaxstreams.jit(fun, streams=2), jax.jit(fun)
    assert repr(ours) == repr(theirs)
    assert (ours.__getstate__()["function_name"]
            == theirs.__getstate__()["function_name"])
  ours = jaxstreams.jit(_divides_in_a_region, streams=2)
  del ours.__wrapped__
  assert repr(ours) == "<PjitFunction>"
  ours, theirs = (jaxstreams.jit(jnp.sin, streams=2), jax.jit(jnp.sin))
  for x in (np.float32(1), np.float32(2), np.arange(3.0)):
    ours(x), theirs(x)
  assert ours._cache_size() == theirs._cache_size() == 2


def _explanations(caplog, jitted):
  """The cache-miss explanations jax logs for a call with new dtypes after
  one call."""
  jitted(np.float32(0), np.float32(1))
  caplog.clear()
  jax.config.update("jax_explain_cache_misses", True)
  try:
    with caplog.at_level("WARNING"):
      jitted(np.float32(0), np.int32(1))
      jitted(np.float32(0), np.int32(1))   # a hit: nothing to explain
  finally:
    jax.config.update("jax_explain_cache_misses", False)
  return [r.getMessage() for r in caplog.records
          if "TRACING CACHE MISS" in r.getMessage()]


def test_cache_miss_explanations_are_jax_jits(caplog, monkeypatch):
  """``jax_explain_cache_misses`` explains a miss of a jaxstreams.jit
  function once, with jax.jit's reason, naming the user's function."""
  monkeypatch.setattr(jaxstreams.config, "read", _streams_option(2))
  def first_of_two(x, y):
    with jaxstreams.stream(1):
      z = jnp.sin(x)
    return z + y
  theirs = _explanations(caplog, jax.jit(first_of_two))
  assert len(theirs) == 1
  assert "at y, now i32[] and before f32[]" in theirs[0]
  for streams in (2, None):
    ours = _explanations(caplog, jaxstreams.jit(first_of_two, streams=streams))
    # The same text after the call site's line (``at file:line``).
    assert [m.split("\n", 1)[1] for m in ours] == \
        [m.split("\n", 1)[1] for m in theirs]


def _with_unread_work(x, w):
  with jaxstreams.stream(1):
    unread = jnp.sin(w) * 2   # nothing reads it
  del unread
  with jaxstreams.stream(2):
    y = jnp.cos(x)
  return y + x


def test_the_traced_program_keeps_unread_work_as_jax_jits():
  """In place (the default way), work nothing reads stays in the traced
  program, as in jax.jit's; jax drops it when lowering."""
  x, w = jnp.arange(3.0), jnp.ones(3)
  primitives = lambda f: [e.primitive.name for e in f.trace(x, w).jaxpr.eqns]
  theirs = jax.jit(_with_unread_work)
  ours = jaxstreams.jit(_with_unread_work, streams=3, gpu_lowering="default")
  assert "sin" in primitives(theirs)
  assert sorted(primitives(ours)) == sorted(primitives(theirs))
  assert_equal_results(ours(x, w), theirs(x, w))


def test_a_tracer_leaked_into_unread_work_fails_the_call_as_with_jax_jit():
  leaked = []

  def leaks(x):
    leaked.append(x * 2)
    return x

  def reads_the_leak_in_unread_work(x):
    with jaxstreams.stream(1):
      jax.lax.scan(lambda c, _: (c, leaked[0] + 1), None, None, length=2)
    return x + 1

  for make in (jax.jit,
               lambda f: jaxstreams.jit(f, streams=2, gpu_lowering="default")):
    leaked.clear()
    make(leaks)(jnp.ones(()))
    with pytest.raises(jax.errors.UnexpectedTracerError,
                       match="was created on line"):
      make(reads_the_leak_in_unread_work)(jnp.ones(()))
