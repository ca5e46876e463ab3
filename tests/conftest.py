"""Test setup shared by every test file.

Four CPU devices are requested before JAX starts, so sharding tests have a
mesh to use on any machine. Every test must leave no jaxstreams worker
thread behind. ``requires_gpu`` marks tests that need a GPU:
they skip without one, and fail instead when JAXSTREAMS_REQUIRE_GPU=1.
``cpu_backend`` marks tests of what jaxstreams does on XLA:CPU (its choices
there, the CPU runtime's handlers): they run where CPU is JAX's default
backend, as in CI, and skip, saying so, where a GPU is. ``gpu_gap(reason)``
marks a promise known not to hold on a GPU (found on the H100 runs): there the
test is reported as an expected failure, not run, with the reason; elsewhere
it runs as usual. ``staged_mode`` runs a test once per way a staged runner
runs.
"""

import gc
import os

import jax
import pytest

import jaxstreams

from jaxstreams.stage import _auto
from programs import FlippingChooser, jaxstreams_threads, wait_until

jax.config.update("jax_num_cpu_devices", 4)
# On a GPU, every jaxstreams.jit function's first call would time its ways
# (jaxstreams_autotune): the tests run the static default instead, and
# tests/test_autotune.py turns timing on where it tests it. Nothing is
# written to the user's autotune cache.
os.environ.setdefault("JAXSTREAMS_AUTOTUNE", "0")
os.environ.setdefault("JAXSTREAMS_AUTOTUNE_CACHE", "none")


@pytest.fixture(autouse=True)
def no_leaked_threads():
  """No test leaves a jaxstreams worker thread behind (prefetch, staged and
  serve workers stop on close, on error and when collected)."""
  before = set(jaxstreams_threads())
  yield
  gc.collect()
  assert wait_until(lambda: set(jaxstreams_threads()) <= before), \
      jaxstreams_threads()


@pytest.fixture
def stream_calls():
  """``jaxstreams.jit`` functions made in the test lower their regions as
  stream calls (``jaxstreams_gpu_lowering="streams"``): for the tests that
  read the calls, events and schedule of the GPU program."""
  jaxstreams.config.update("jaxstreams_gpu_lowering", "streams")
  yield
  jaxstreams.config.reset("jaxstreams_gpu_lowering")


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
  config.addinivalue_line(
      "markers", "cpu_backend: the test checks behaviour on XLA:CPU, JAX's default there")
  config.addinivalue_line(
      "markers", "gpu_gap(reason): a promise known not to hold on a GPU (xfail there)")


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() != "gpu":
    return
  for item in items:
    gap = item.get_closest_marker("gpu_gap")
    if gap is not None:
      item.add_marker(pytest.mark.xfail(
          run=False, reason=f"known gap on a GPU: {gap.args[0]}"))


def pytest_runtest_setup(item):
  if "cpu_backend" in item.keywords and jax.default_backend() != "cpu":
    pytest.skip(f"checks XLA:CPU behaviour; JAX's default backend here is "
                f"{jax.default_backend()}")
  if "gpu" not in item.keywords or _has_gpu():
    return
  if os.environ.get("JAXSTREAMS_REQUIRE_GPU") == "1":
    pytest.fail("JAXSTREAMS_REQUIRE_GPU=1 but no GPU is visible to JAX")
  pytest.skip("needs a GPU (set JAXSTREAMS_REQUIRE_GPU=1 to fail instead)")
