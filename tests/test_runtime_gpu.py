"""The CUDA implementation of the runtime handlers, on a real GPU.

Marked `gpu`: skipped without a GPU, failed instead when
JAXSTREAMS_REQUIRE_GPU=1 (tests/conftest.py). They mirror the CPU tests:
ordering by events between a slow kernel and a reader on another stream,
stage data through pinned and device slots on the copy stream, overlapping
regions in the timeline, and a compute-sanitizer run.
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

import jaxstreams.runtime as rt
from jaxstreams.runtime import timeline

pytestmark = pytest.mark.gpu

SLOW_US = 200_000


@pytest.fixture(scope="module", autouse=True)
def cuda_runtime():
  if "cuda" not in rt.available_platforms():
    pytest.fail("a GPU is visible but libjaxstreams_cuda.so did not load: "
                f"{rt._loader._errors.get('cuda')}")
  cfg = rt.init()
  assert cfg.gpu_devices, cfg
  return cfg


def _gpu_markers():
  return [m for m in timeline.read().markers if m.platform == "cuda"]


def test_identity_on_the_gpu():
  x = jnp.arange(1000, dtype=jnp.float32)
  assert jax.jit(rt.identity)(x).devices() == x.devices()
  np.testing.assert_array_equal(jax.jit(rt.identity)(x), x)
  assert ("custom_call @jaxstreams_identity"
          in jax.jit(rt.identity).lower(x).as_text())


def test_reader_on_another_stream_waits_for_a_slow_kernel():
  """A spin kernel on runtime stream 1, an event recorded after it, runtime
  stream 2 waits for it: stream 2's timestamp comes after the kernel ended,
  although the host enqueued everything at once."""
  e1, e2 = rt.allocate_event(), rt.allocate_event()

  def program(x):
    x = rt.marker(x, region=1, phase=rt.INSTANT, track=1, stream=1)
    x = rt.delay(x, microseconds=SLOW_US, stream=1)
    x = rt.record(x, event=e1, stream=1)
    x = rt.wait(x, event=e1, stream=2)
    x = rt.marker(x, region=2, phase=rt.INSTANT, track=2, stream=2)
    x = rt.record(x, event=e2, stream=2)
    return rt.wait(x, event=e2)  # join back into XLA's stream

  x = jnp.ones(16)
  compiled = jax.jit(program).lower(x).compile()
  timeline.reset()
  np.testing.assert_array_equal(jax.block_until_ready(compiled(x)), x)
  marks = {m.region: m for m in _gpu_markers()}
  assert marks[2].t_ns - marks[1].t_ns >= 0.9 * SLOW_US * 1e3
  rt.release_event(e1)
  rt.release_event(e2)


def test_stage_slow_copy_stream_and_a_reader_on_xlas_stream():
  """The copy stream is slowed by a spin kernel before each transfer; the
  consumer on XLA's stream waits for the slot's ready event and sees the new
  data every time, with slots reused."""
  spec = jax.ShapeDtypeStruct((1 << 16,), jnp.float32)
  with rt.StageArea(spec, capacity=2, platform="cuda",
                    timeout_ms=10_000) as stage:
    step = jax.jit(lambda: stage.get() * 2.0)
    for i in range(6):
      item = (np.full((1 << 16,), i, np.float32)
              + np.arange(1 << 16, dtype=np.float32))
      stage.put(item, delay_us=20_000)
      np.testing.assert_array_equal(jax.block_until_ready(step()), item * 2.0)
    stats = stage.stats()
    assert (stats.puts, stats.gets, stats.free_slots) == (6, 6, 2)


def test_timeline_shows_two_overlapping_gpu_streams(tmp_path):
  def program(x):
    for stream in (1, 2):
      x = rt.marker(x, region=stream, phase=rt.BEGIN, track=stream,
                    stream=stream)
      x = rt.delay(x, microseconds=100_000, stream=stream)
      x = rt.marker(x, region=stream, phase=rt.END, track=stream, stream=stream)
    return x

  x = jnp.zeros(4)
  compiled = jax.jit(program).lower(x).compile()
  timeline.reset()
  jax.block_until_ready(compiled(x))
  rt.synchronize()
  a, b = sorted(timeline.intervals(_gpu_markers()), key=lambda iv: iv.track)
  assert min(a.duration_ns, b.duration_ns) >= 90e6
  assert a.overlaps(b)
  trace = timeline.write_chrome_trace(tmp_path / "gpu.json", _gpu_markers())
  assert sum(ev["ph"] == "X" for ev in trace["traceEvents"]) == 2


def test_errors_on_the_gpu_are_exceptions():
  x = jnp.ones(3)
  from jaxstreams.runtime import _ops
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"event 1000000 is out of range"):
    jax.block_until_ready(jax.jit(
        lambda v: _ops.record_p.bind(v, event=10**6, stream=-1))(x))
  cpu_stage = rt.StageArea(jax.ShapeDtypeStruct((3,), jnp.float32),
                           platform="cpu")
  # NOT_FOUND may reach Python as JaxRuntimeError or a builtin; the message
  # is what matters.
  with pytest.raises(Exception, match="belongs to a CPU stage"):
    jax.block_until_ready(jax.jit(lambda: cpu_stage.get())())
  cpu_stage.destroy()
  np.testing.assert_array_equal(jax.jit(rt.identity)(x), x)  # still usable


def _sanitizer():
  found = shutil.which("compute-sanitizer")
  if found:
    return found
  candidate = "/usr/local/cuda/bin/compute-sanitizer"
  return candidate if os.path.exists(candidate) else None


def test_compute_sanitizer_reports_no_errors(tmp_path):
  tool = _sanitizer()
  if tool is None:
    pytest.skip("compute-sanitizer is not installed")
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      import jaxstreams.runtime as rt
      rt.init()
      e = rt.allocate_event()
      f = jax.jit(lambda x: rt.wait(rt.record(rt.delay(x, microseconds=1000,
                                                       stream=1),
                                              event=e, stream=1), event=e))
      np.testing.assert_array_equal(f(jnp.ones(8)), np.ones(8))
      with rt.StageArea(jax.ShapeDtypeStruct((256,), jnp.float32),
                        platform="cuda") as s:
        for i in range(3):
          s.put(np.full(256, i, np.float32))
          np.testing.assert_array_equal(jax.jit(lambda: s.get())(),
                                        np.full(256, i))
      rt.timeline.reset(16)
      jax.block_until_ready(
          jax.jit(lambda x: rt.marker(x, region=1))(jnp.ones(2)))
      print(len(rt.timeline.read().markers), "markers")
      """)
  proc = subprocess.run(
      [tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable,
       "-c", script],
      capture_output=True, text=True, timeout=900,
      env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
  out = proc.stdout + proc.stderr
  (tmp_path / "sanitizer.txt").write_text(out)
  assert proc.returncode == 0, out[-4000:]
  assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]
