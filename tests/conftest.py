"""Test setup shared by every test file.

Four CPU devices are requested before JAX starts, so sharding tests have a
mesh to use on any machine. Every test must leave no jaxstreams worker
thread behind. ``requires_gpu`` marks tests that need a GPU:
they skip without one, and fail instead when JAXSTREAMS_REQUIRE_GPU=1.
"""

import gc
import os

import jax
import pytest

from programs import jaxstreams_threads, wait_until

jax.config.update("jax_num_cpu_devices", 4)


@pytest.fixture(autouse=True)
def no_leaked_threads():
  """No test leaves a jaxstreams worker thread behind (prefetch, staged and
  serve workers stop on close, on error and when collected)."""
  before = set(jaxstreams_threads())
  yield
  gc.collect()
  assert wait_until(lambda: set(jaxstreams_threads()) <= before), \
      jaxstreams_threads()


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: the test needs a GPU")


def pytest_runtest_setup(item):
  if "gpu" not in item.keywords or _has_gpu():
    return
  if os.environ.get("JAXSTREAMS_REQUIRE_GPU") == "1":
    pytest.fail("JAXSTREAMS_REQUIRE_GPU=1 but no GPU is visible to JAX")
  pytest.skip("needs a GPU (set JAXSTREAMS_REQUIRE_GPU=1 to fail instead)")
