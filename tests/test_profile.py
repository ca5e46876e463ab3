"""jaxstreams.profile(): region markers, the timeline, and nothing when off."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from programs import assert_equal_results, random_inputs, two_towers


@pytest.fixture
def towers():
  x, w1, w2 = random_inputs((16, 32), (32, 32), (32, 32))
  return jaxstreams.jit(two_towers, streams=3), (x, w1, w2)


def test_profile_records_every_region_on_its_stream(towers, tmp_path):
  f, args = towers
  plan = f.plan(*args)
  path = tmp_path / "trace.json"
  with jaxstreams.profile(path) as prof:
    out = f(*args)
    f(*args)              # never read: the block's exit waits for it all the
                          # same
  assert len(prof.intervals) == 2 * len(plan.regions)
  by_region = {}
  for interval in prof.intervals:
    assert interval.end_ns >= interval.start_ns
    by_region.setdefault(prof.region_name(interval.region), set()).add(
        interval.track)
  assert by_region == {f"two_towers/R{r.index}": {r.stream}
                       for r in plan.regions}
  np.testing.assert_allclose(out, jax.jit(two_towers)(*args), rtol=1e-6)

  trace = json.loads(path.read_text())
  rows = {e["args"]["name"] for e in trace["traceEvents"]
          if e.get("name") == "thread_name"}
  assert rows == {"stream 0", "stream 1", "stream 2"}
  spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
  assert {e["name"] for e in spans} == set(by_region)
  assert all(e["dur"] >= 0 for e in spans)


def test_no_markers_when_profiling_is_off(towers):
  f, args = towers
  assert "jaxstreams_marker" not in f.lower(*args).as_text()
  with jaxstreams.profile():
    profiled = f.lower(*args).as_text()
  assert profiled.count("jaxstreams_marker") == 2 * len(f.plan(*args).regions)
  # Leaving the block goes back to the unprofiled program.
  assert "jaxstreams_marker" not in f.lower(*args).as_text()


def test_the_option_turns_profiling_on_for_new_traces():
  jaxstreams.config.update("jaxstreams_profile", True)
  try:
    f = jaxstreams.jit(lambda x: _one_region(x), streams=2)
    assert f.lower(jnp.ones(4)).as_text().count("jaxstreams_marker") == 4
  finally:
    jaxstreams.config.reset()


def _one_region(x):
  with jaxstreams.stream(1):
    y = jnp.sin(x)
  return y + 1


def test_profiled_gradients_still_work(towers):
  f, args = towers
  with jaxstreams.profile() as prof:
    # Not blocked on: the block's exit waits for the step, inside another
    # jax.jit too.
    grads = jax.jit(jax.grad(f, argnums=1))(*args)
  assert_equal_results(grads, jax.jit(jax.grad(two_towers, argnums=1))(*args))
  assert prof.intervals
