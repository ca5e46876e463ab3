"""What differs between the jax versions jaxstreams supports (0.10, 0.11, 0.12)
works on the one running the tests.

Closures: from jax 0.11 a jaxpr's constants are the leading inputs with values
attached, so a traced function that closes over arrays is where a version
difference shows first. Each closure below is checked bitwise against
``jax.jit`` and for a plan that names the constants as constants.

The native library: jaxlib refuses FFI handlers compiled against newer
headers than its own, so the loader checks the library's FFI API version
against the running jaxlib's before registering anything.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from programs import assert_equal_results, random_inputs

# These read the GPU program's stream calls (or compare programs that have
# them): jaxstreams.jit functions are made with the 'streams' lowering.
pytestmark = pytest.mark.usefixtures("stream_calls")

NUMPY_WEIGHT = np.linspace(-1.0, 1.0, 16 * 16, dtype=np.float32).reshape(16, 16)
NUMPY_BIAS = np.arange(16, dtype=np.float32) / 7.0


def jax_constants():
  """Closed-over jax arrays (made on first use: no jax work at import)."""
  w, b = random_inputs((16, 16), (16,), seed=3)
  return w, b


def closing_over(w, b):
  """A two-stream function of ``x`` that reads ``w`` and ``b`` from its
  closure, on both streams and in the join."""
  def f(x):
    with jaxstreams.stream(1):
      h = jnp.tanh(x @ w) + b
    g = jnp.sin(x) * b
    return (h * g).sum(axis=0) + w[0]
  return f


@pytest.fixture(params=["numpy", "jax"])
def constants(request):
  if request.param == "numpy":
    return NUMPY_WEIGHT, NUMPY_BIAS
  return jax_constants()


def const_inputs(plan):
  """The constant names (c0, c1, ...) the plan's regions read."""
  return {name for region in plan.regions for name in region.inputs
          if name.startswith("c")}


@pytest.mark.parametrize("spread", [False, True])
def test_closure_over_arrays_bitwise_equal_to_jax_jit(constants, spread):
  f = closing_over(*constants)
  x, = random_inputs((8, 16))
  g = jaxstreams.jit(f, streams=2, spread=spread)
  assert_equal_results(g(x), jax.jit(f)(x))
  plan = g.plan(x)
  # One argument; the closed-over arrays are constants, not arguments.
  argument_names = {name for region in plan.regions for name in region.inputs
                    if name.startswith("a")}
  assert argument_names == {"a0"}
  assert const_inputs(plan)
  assert any(region.stream == 1 for region in plan.regions)


@pytest.mark.parametrize("spread", [False, True])
def test_gradient_of_closure_bitwise_equal_to_jax_jit(constants, spread):
  f = closing_over(*constants)
  x, = random_inputs((8, 16), seed=1)

  def loss(x):
    return jnp.sum(f(x) ** 2)

  inside = jax.value_and_grad(loss)
  expected = jax.jit(inside)(x)
  assert_equal_results(jaxstreams.jit(inside, streams=2, spread=spread)(x),
                       expected)
  # jax.grad applied from outside, to a jaxstreams function.
  outside = jax.jit(jax.grad(lambda x: jnp.sum(
      jaxstreams.jit(f, streams=2, spread=spread)(x) ** 2)))
  assert_equal_results(outside(x), expected[1])


@pytest.mark.parametrize("spread", [False, True])
def test_closure_over_an_outer_jit_tracer(spread):
  x, w, b = random_inputs((8, 16), (16, 16), (16,), seed=2)

  def outer(w, b, x):
    return jaxstreams.jit(closing_over(w, b), streams=2, spread=spread)(x)

  def reference(w, b, x):
    return jax.jit(closing_over(w, b))(x)

  assert_equal_results(jax.jit(outer)(w, b, x), jax.jit(reference)(w, b, x))
  grad = jax.jit(jax.grad(lambda w: outer(w, b, x).sum()))
  expected = jax.jit(jax.grad(lambda w: reference(w, b, x).sum()))
  assert_equal_results(grad(w), expected(w))


def test_nested_jit_with_tags_closing_over_constants_is_inlined():
  w, b = jax_constants()
  x, = random_inputs((8, 16), seed=4)

  @jax.jit
  def inner(x):
    with jaxstreams.stream(1):
      y = jnp.tanh(x @ w) + NUMPY_BIAS
    return y * b

  def f(x):
    return inner(x) + inner(x * 2.0) + b

  g = jaxstreams.jit(f, streams=2)
  assert_equal_results(g(x), jax.jit(f)(x))
  plan = g.plan(x)
  assert sum(region.stream == 1 for region in plan.regions) >= 1
  assert const_inputs(plan)


def test_closure_in_served_function():
  f = closing_over(*jax_constants())
  x, = random_inputs((8, 16), seed=5)
  with jaxstreams.serve(f, groups=2) as server:
    assert_equal_results(server(x), jax.jit(f)(x))


@pytest.mark.parametrize("mode", ["fused", "plain"])
@pytest.mark.parametrize("smart", [False, True])
def test_staged_step_closing_over_arrays(constants, mode, smart):
  w, b = constants
  batches = [np.full((4, 16), i, np.float32) for i in range(4)]

  def produce(batch):
    return jnp.tanh(batch @ w) + b

  def step(scale, batch):
    staged_value = produce(batch) if smart else jaxstreams.stage(produce(batch))
    return (staged_value * scale).sum(axis=0)

  scale = jnp.float32(0.5)
  expected = [jax.jit(step)(scale, batch) for batch in batches]
  with jaxstreams.staged(step, data=iter(batches), smart=smart,
                         mode=mode) as runner:
    assert_equal_results([runner(scale) for _ in batches], expected)


# ---------------------------------------------------------------------------
# The native library's XLA FFI API version against the running jaxlib's.

# What each supported jaxlib's headers say (checked by hand on each wheel).
KNOWN_JAXLIB_FFI_API = {"0.10.2": "0.3", "0.11.2": "0.4", "0.12.0.1": "0.5"}


def test_jaxlib_ffi_api_version_is_read_from_its_headers():
  import jaxlib
  from jaxstreams.runtime import _loader
  version = _loader.jaxlib_ffi_api_version()
  assert version is not None
  if jaxlib.__version__ not in KNOWN_JAXLIB_FFI_API:
    pytest.skip(f"no recorded FFI API version for jaxlib {jaxlib.__version__}")
  assert (_loader.ffi_api_text(version)
          == KNOWN_JAXLIB_FFI_API[jaxlib.__version__])


def test_loaded_library_is_one_the_running_jaxlib_accepts():
  import jaxstreams.runtime as rt
  from jaxstreams.runtime import _capi, _loader
  library = _capi.CApi(_loader.require("cpu"))._fns["FfiApiVersion"]()
  assert _loader.ffi_api_accepted(library, _loader.jaxlib_ffi_api_version())
  assert "cpu" in rt.available_platforms()


def _fake_cpu_library(tmp_path, ffi_api_version):
  """A directory holding a libjaxstreams_cpu.so that passes the loader's ABI
  and C API checks and reports ``ffi_api_version``. It has no handlers: past
  the FFI API check the loader refuses it for that, in other words."""
  from jaxstreams.runtime import _loader
  prefix = _loader._PLATFORMS["cpu"][2]
  values = {"AbiVersion": _loader.ABI_VERSION, "FfiApiVersion": ffi_api_version}
  source = tmp_path / "fake.c"
  source.write_text("".join(
      f'__attribute__((visibility("default"))) int {prefix}{name}(void) '
      f"{{ return {values.get(name, 0)}; }}\n"
      for name in _loader.CAPI_FUNCTIONS))
  lib_dir = tmp_path / f"ffi_api_{ffi_api_version}"
  lib_dir.mkdir()
  compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
  if compiler is None:
    pytest.skip("no C compiler to build a stand-in library")
  subprocess.run([compiler, "-shared", "-fPIC", "-o",
                  str(lib_dir / "libjaxstreams_cpu.so"), str(source)],
                 check=True, capture_output=True)
  return lib_dir


def test_library_newer_than_jaxlib_is_refused_naming_both_versions(tmp_path):
  import jaxlib
  from jaxstreams.runtime import _loader
  running = _loader.jaxlib_ffi_api_version()
  for newer in (running + 1, (running // 1000 + 1) * 1000):
    message = _loader._load_platform("cpu",
                                     [_fake_cpu_library(tmp_path, newer)])
    assert isinstance(message, str)
    assert (f"compiled against XLA FFI API {_loader.ffi_api_text(newer)}"
            in message)
    assert f"jaxlib {jaxlib.__version__} has XLA FFI API " \
           f"{_loader.ffi_api_text(running)}" in message
    assert "pip install --force-reinstall --no-deps ." in message
    assert "cmake -S ffi" in message


def test_library_as_old_as_or_older_than_jaxlib_passes_the_check(tmp_path):
  from jaxstreams.runtime import _loader
  running = _loader.jaxlib_ffi_api_version()
  for version in [running] + ([running - 1] if running % 1000 else []):
    message = _loader._load_platform("cpu",
                                     [_fake_cpu_library(tmp_path, version)])
    # Accepted by the FFI API check, so refused by the next one: no handlers.
    assert "does not export the handler" in message, message
    assert "XLA FFI API" not in message


def test_jax_keeps_working_when_the_library_is_too_new(tmp_path):
  """A refused library leaves jax and jaxstreams.jit working; only the runtime
  raises, with the versions and how to rebuild."""
  from jaxstreams.runtime import _loader
  lib_dir = _fake_cpu_library(tmp_path, _loader.jaxlib_ffi_api_version() + 1)
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      import jaxstreams, jaxstreams.runtime as rt
      assert rt.available_platforms() == (), rt.available_platforms()
      def f(x):
        with jaxstreams.stream(1):
          y = jnp.sin(x) * 2.0
        return y + x
      x = jnp.arange(8.0)
      np.testing.assert_array_equal(jaxstreams.jit(f, streams=2)(x),
                                    jax.jit(f)(x))
      try:
        rt.identity(1.0)
      except rt.RuntimeLibraryError as e:
        print(e)
      else:
        raise SystemExit("no error")
      """)
  env = dict(os.environ, JAXSTREAMS_FFI_LIB_DIR=str(lib_dir),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", script], env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "XLA FFI API" in proc.stdout and "Rebuild jaxstreams" in proc.stdout
  assert "Unable to initialize backend" not in proc.stdout + proc.stderr
