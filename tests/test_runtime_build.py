"""The native build chain end to end: the FFI libraries built by CMake are
found, registered and called through jax.jit, and a missing library gives a
clear message instead of an XLA error."""

import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams.runtime as rt


def _bits(a):
  """Raw bytes of an array, so NaN payloads and -0.0 compare exactly."""
  a = np.asarray(a)
  return a.dtype, a.shape, a.tobytes()


DTYPES = [np.float32, np.int8, np.uint16, np.bool_, jnp.bfloat16, np.complex64,
          np.int32]
SHAPES = [(), (0,), (7,), (3, 4, 5)]


def _sample(dtype, shape):
  rng = np.random.default_rng(0)
  n = int(np.prod(shape))
  raw = rng.integers(0, 256, size=n * np.dtype(dtype).itemsize, dtype=np.uint8)
  x = raw.view(dtype).reshape(shape) if n else np.zeros(shape, dtype)
  if dtype == np.bool_:
    x = raw.astype(bool).reshape(shape)
  return x


def test_cpu_library_is_loaded():
  assert "cpu" in rt.available_platforms()
  assert rt.library_path("cpu").name == "libjaxstreams_cpu.so"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_identity_under_jit_is_exact(dtype):
  f = jax.jit(rt.identity)
  for shape in SHAPES:
    x = _sample(dtype, shape)
    assert _bits(f(x)) == _bits(x), (dtype, shape)


def test_identity_eager_and_inside_a_computation():
  x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
  np.testing.assert_array_equal(rt.identity(x), x)
  y = jax.jit(lambda v: rt.identity(v * 2.0) + 1.0)(x)
  np.testing.assert_array_equal(y, x * 2.0 + 1.0)


def test_lowering_names_the_custom_call_target():
  x = jnp.ones((4,), jnp.float32)
  text = jax.jit(rt.identity).lower(x).as_text()
  assert "stablehlo.custom_call @jaxstreams_identity" in text


@pytest.mark.skipif("cuda" not in rt.available_platforms(),
                    reason="CUDA library not built")
def test_lowering_for_cuda_when_the_cuda_library_is_built():
  x = jnp.ones((4,), jnp.float32)
  lowered = jax.jit(rt.identity).trace(x).lower(lowering_platforms=("cuda",))
  assert "stablehlo.custom_call @jaxstreams_identity" in lowered.as_text()


def _run(script, lib_dir):
  env = dict(os.environ, JAXSTREAMS_FFI_LIB_DIR=str(lib_dir),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)],
                        env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


def test_missing_libraries_give_clear_errors(tmp_path):
  """No library: importing works, using the runtime names the file, the
  searched directory and how to build it. CPU library only: CPU works and
  lowering for CUDA names the missing CUDA library."""
  empty = tmp_path / "empty"
  empty.mkdir()
  out = _run("""
      import jaxstreams, jaxstreams.runtime as rt
      assert rt.available_platforms() == (), rt.available_platforms()
      try:
        rt.identity(1.0)
      except rt.RuntimeLibraryError as e:
        assert isinstance(e, ImportError)
        print(e)
      else:
        raise SystemExit("no error")
      """, empty)
  assert "libjaxstreams_cpu.so was not found" in out
  assert str(empty) in out
  assert "JAXSTREAMS_FFI_LIB_DIR" in out and "pip install ." in out

  cpu_only = tmp_path / "cpu_only"
  cpu_only.mkdir()
  shutil.copy(rt.library_path("cpu"), cpu_only)
  out = _run("""
      import jax, jax.numpy as jnp, jaxstreams.runtime as rt
      assert rt.available_platforms() == ("cpu",), rt.available_platforms()
      assert float(jax.jit(rt.identity)(jnp.float32(3.0))) == 3.0
      try:
        jax.jit(rt.identity).trace(jnp.ones(2)).lower(lowering_platforms=("cuda",))
      except rt.RuntimeLibraryError as e:
        print(e)
      else:
        raise SystemExit("no error")
      """, cpu_only)
  assert "libjaxstreams_cuda.so was not found" in out
  assert "CUDA toolkit" in out
  assert "'jaxstreams_identity' for cuda" in out


def test_import_loads_nothing_and_the_first_runtime_op_loads_and_registers():
  """`import jaxstreams`, `jit` and `plan` map no native library and register
  no FFI target; a program holding a runtime op (bound directly, so only its
  lowering can load the library) still finds its target registered."""
  _run("""
      import jax, jax.numpy as jnp
      import jaxstreams
      from jaxstreams.runtime import _loader, _ops

      def mapped():
        with open("/proc/self/maps") as maps:
          return "libjaxstreams" in maps.read()

      assert not mapped() and not _loader._loaded and not _loader._done

      def f(x):
        with jaxstreams.stream(1):
          y = jnp.sin(x)
        return y + jnp.cos(x)
      x = jnp.arange(4.0)
      assert jnp.array_equal(jaxstreams.jit(f, streams=2)(x), jax.jit(f)(x))
      assert len(jaxstreams.plan(f, streams=2)(x).regions) >= 1
      assert not mapped() and not _loader._loaded and not _loader._done

      out = jax.jit(lambda v: _ops.identity_p.bind(v))(x)
      assert jnp.array_equal(out, x)
      assert mapped() and "cpu" in _loader._loaded
      """, rt.library_path("cpu").parent)
