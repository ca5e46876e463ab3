"""Test setup shared by every test file.

Four CPU devices are requested before JAX starts, so sharding tests have a
mesh to use on any machine. Every test must leave no jaxstreams worker
thread behind. ``requires_gpu`` marks tests that need a GPU:
they skip without one, and fail instead when JAXSTREAMS_REQUIRE_GPU=1.
``staged_mode`` runs a test once per way a staged runner runs.
"""

import gc
import os

import jax
import pytest

from jaxstreams.stage import _auto
from programs import FlippingChooser, jaxstreams_threads, wait_until

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


@pytest.fixture(params=["fused", "threads", "plain", "switching"])
def staged_mode(request, monkeypatch):
  """The ``mode=`` to pass to ``jaxstreams.staged`` for one way of running:
  staged (fused, or threads), plain, and ``mode="auto"`` with its chooser
  replaced by one that switches between plain and fused every two calls,
  so that every promise is checked across switches."""
  if request.param == "switching":
    monkeypatch.setattr(_auto, "Chooser", FlippingChooser)
    return "auto"
  return request.param


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
