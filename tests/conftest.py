"""Test setup shared by every test file.

Four CPU devices are requested before JAX starts, so sharding tests have a
mesh to use on any machine. Every test must leave no jaxstreams worker
thread behind. ``staged_mode`` runs a test once per way a staged runner
runs. Tests decide on events and counts, not on how long something took:
waits are bounded by generous timeouts so that a bug fails instead of
hanging; the few lower bounds on time (a wait that must outlast a sleep)
cannot fail from load, and the two upper bounds leave a margin the test
explains (``put`` returns before a 1 s copy; ``close(timeout=0.05)``
returns within 5 s). The suite runs in two xdist workers
(``scripts/test.sh``) and passes with a second suite beside it.

What skips, and why (each says so in its reason):

- ``gpu`` (``test_gpu_core.py``, ``test_runtime_gpu.py``): needs a GPU.
  Without one they skip; with ``JAXSTREAMS_REQUIRE_GPU=1`` they fail.
- ``cpu_backend`` (``test_runtime_cpu.py`` and single tests elsewhere):
  checks what jaxstreams does on XLA:CPU (the CPU runtime's handlers, its
  choices there); skips where a GPU is JAX's default backend.
- The deviceless H100 compiles (``require_gpu_target``) skip without the
  CUDA plugin or ``ptxas``; ``scripts/test.sh`` installs them and sets
  ``JAXSTREAMS_REQUIRE_GPU_TARGET=1``, so in CI they fail instead.
- Conditions of the machine, not of jaxstreams: running as root (a file
  root can read is not an unreadable rules file), ``overcommit_memory=1``
  (a huge allocation succeeds), no compute-sanitizer, no C compiler, a
  jaxlib whose FFI API version is not on record, the CUDA runtime library
  not built.
- No PyTorch (not among the test extras: its wheels are large):
  ``test_torch_anchor.py``, the check that the benchmarks' PyTorch anchor
  computes what the flax.linen model does, skips saying so.
- One version rule: before jax 0.12 (``XLA_SCHEDULES_STREAM_CALLS``
  false), XLA does not schedule stream calls itself, so the test of how
  jaxstreams packs a region it pins skips on 0.12, where it pins none.

Strict expected failures that wait on other work name it in their reason
(none does now); they fail loudly once it lands, to be turned into tests.

Two tiers, and what runs on which jax (markers):

- ``slow``: a test over the budget of 20 s on 2 cores, each marked with its
  reason (``@pytest.mark.slow(reason=...)``). ``scripts/test.sh``, the
  README's command, leaves them out so that it answers within 8 minutes,
  setup included; ``JAXSTREAMS_TEST_TIER=all`` runs them, and ``.ci/run``
  runs every tier. They are the compile matrix (every program x context x
  way, compiled for an H100), the benchmark suite's quick run, and the
  end-to-end runs of the largest programs. The quick tier runs the
  property test with 20 examples, CI's first jax with 60.
- ``once``: a check whose outcome does not depend on the jax version runs
  on CI's first jax only (``.ci/run`` deselects it on the others): the
  end-to-end runs of the benchmark scripts and examples (each exercises
  jax through the library code the rest of the suite tests on every jax),
  the compile matrix's ways beyond the default (the default's cells, where
  the versions' programs differ, run on every jax, but those of four suite
  models whose constructs the smaller programs hold:
  ``test_compile_matrix.DEFAULT_ONCE``; each way's program is checked on
  every jax by the view's tests), and the checks that read
  only this checkout's files (layout, docs' links, options). Everything
  that lowers, compiles or runs a program through ``_compat`` runs on
  every jax.

At the end of a run the terminal summary lists every test over the budget
that is not marked ``slow`` (a report, not a failure: tests never assert
on timings). Compiles for a GPU target made in the view's child process
are kept for the whole run in one directory (``jaxstreams_compile_cache``)
that the workers and their child processes share: a program the run
compiled once is read back.

One expected failure: ``test_profiled_regions_overlap_in_time`` under
stream calls on a GPU with jax < 0.12, strict, because XLA's CUDA graph
chains stream calls there (``docs/xla.md``; jaxstreams' GPU default is not
stream calls for that reason); it fails loudly if that changes.
"""

import gc
import glob
import os
import pathlib
import shutil
import sys
import tempfile

import jax
import pytest

import jaxstreams

from jaxstreams.staging import _policy
from programs import FlippingChooser, jaxstreams_threads, wait_until

# The checkout last on sys.path: tests import the benchmarks' workloads
# (``benchmarks.workloads``), while the installed jaxstreams, with its
# native libraries, comes first.
sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent))

jax.config.update("jax_num_cpu_devices", 4)
# On a GPU, every jaxstreams.jit function's first call would time its ways
# (jaxstreams_autotune): the tests run the static default instead, and
# tests/test_autotune.py turns timing on where it tests it. Nothing is
# written to the user's autotune cache.
os.environ.setdefault("JAXSTREAMS_AUTOTUNE", "0")
os.environ.setdefault("JAXSTREAMS_AUTOTUNE_CACHE", "none")
# With autotuning off, the default on an H100 or H200 would choose by the
# step-time estimate (jaxstreams_estimate_target=auto), compiling every way
# in a child: on a GPU the tests check the structural default, and
# tests/test_step_time.py tests the estimate where it sets it.
if glob.glob("/dev/nvidia[0-9]*"):
  os.environ.setdefault("JAXSTREAMS_ESTIMATE_TARGET", "none")


@pytest.fixture(autouse=True)
def no_leaked_threads():
  """No test leaves a jaxstreams worker thread behind (prefetch, staged and
  serve workers stop on close, on error and when collected)."""
  before = set(jaxstreams_threads())
  yield
  settled = lambda: set(jaxstreams_threads()) <= before
  # A full collection takes about a second with jax, flax and equinox
  # loaded: only where a worker is still there after a moment (one that
  # stops when its owner is collected).
  if not wait_until(settled, seconds=0.2):
    gc.collect()
    assert wait_until(settled), jaxstreams_threads()


def pytest_collection_finish(session):
  """What the imports and collection made lives to the end: moved out of
  the collector's sight, so that each collection (Python's own, and the
  tests' gc.collect) walks only what the tests made."""
  del session
  gc.collect()
  gc.freeze()


@pytest.fixture
def stream_calls():
  """``jaxstreams.jit`` functions made in the test lower their regions as
  stream calls (``jaxstreams_gpu_lowering="streams"``): for the tests that
  read the calls, events and schedule of the GPU program."""
  jaxstreams.config.update("jaxstreams_gpu_lowering", "streams")
  yield
  jaxstreams.config.reset("jaxstreams_gpu_lowering")


@pytest.fixture(params=["fused", "plain", "switching"])
def staged_mode(request, monkeypatch):
  """The ``mode=`` to pass to ``jaxstreams.staged`` for one way of running:
  staged (fused), plain, and ``mode="measured"`` with its chooser
  replaced by one that switches between plain and fused every two calls,
  so that every promise is checked across switches."""
  if request.param == "switching":
    monkeypatch.setattr(_policy, "Chooser", FlippingChooser)
    return "measured"
  return request.param


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def pytest_configure(config):
  # One cache of compiles for a GPU target for the whole run: its workers
  # and every child process they start (the compile matrix's, the view's)
  # read what another compiled (jaxstreams.xla.kept_compiles). Made by the
  # process that starts the workers, before it starts them; removed by it
  # at the end.
  if ("JAXSTREAMS_COMPILE_CACHE" not in os.environ
      and "PYTEST_XDIST_WORKER" not in os.environ):
    os.environ["JAXSTREAMS_COMPILE_CACHE"] = tempfile.mkdtemp(
        prefix="jaxstreams-test-compiles-")
    config._jaxstreams_compile_cache = os.environ["JAXSTREAMS_COMPILE_CACHE"]
  config.addinivalue_line("markers", "gpu: the test needs a GPU")
  config.addinivalue_line(
      "markers", "once: an end-to-end or exhaustive run that CI runs on one "
      "jax only (see this module's docstring)")
  config.addinivalue_line(
      "markers", "cpu_backend: the test checks behaviour on XLA:CPU, JAX's "
      "default there")
  config.addinivalue_line(
      "markers", "slow(reason): over the 20 s budget on 2 cores; the README's "
      "command leaves it out, CI runs it (see this module's docstring)")


BUDGET_S = 20.0


def pytest_terminal_summary(terminalreporter):
  """Tests over the budget that are not marked ``slow``, by duration."""
  over = []
  for reports in terminalreporter.stats.values():
    for report in reports:
      if (getattr(report, "when", None) == "call"
          and report.duration > BUDGET_S
          and "slow" not in getattr(report, "keywords", {})):
        over.append((report.duration, report.nodeid))
  if over:
    terminalreporter.write_sep("-", f"over the {BUDGET_S:g} s budget, not "
                               "marked slow")
    for duration, nodeid in sorted(over, reverse=True):
      terminalreporter.write_line(f"{duration:7.1f}s {nodeid}")


def pytest_unconfigure(config):
  made = getattr(config, "_jaxstreams_compile_cache", None)
  if made:
    shutil.rmtree(made, ignore_errors=True)


def pytest_runtest_setup(item):
  if "cpu_backend" in item.keywords and jax.default_backend() != "cpu":
    pytest.skip(f"checks XLA:CPU behaviour; JAX's default backend here is "
                f"{jax.default_backend()}")
  if "gpu" not in item.keywords or _has_gpu():
    return
  if os.environ.get("JAXSTREAMS_REQUIRE_GPU") == "1":
    pytest.fail("JAXSTREAMS_REQUIRE_GPU=1 but no GPU is visible to JAX")
  pytest.skip("needs a GPU (set JAXSTREAMS_REQUIRE_GPU=1 to fail instead)")
