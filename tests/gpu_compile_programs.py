"""Compiles the examples' and benchmarks' programs for an H100 without one and
prints each one's XLA schedule as JSON (one line). Run by
tests/test_gpu_compile.py in a process of its own, because deviceless
compilation needs JAX_PLATFORMS=cpu before jax starts.

    JAX_PLATFORMS=cpu python tests/gpu_compile_programs.py [name ...]
"""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]
# The checkout last: the installed jaxstreams (with its native libraries)
# comes first, as in the tests; a checkout that is not installed still runs.
sys.path.append(str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxstreams  # noqa: E402


def two_tower_demo():
  import streams_demo
  params = streams_demo.init(2, 256, 2, jax.random.PRNGKey(0))
  x = jnp.ones((64, 256))
  y = jnp.ones((64, 1))
  return streams_demo.make_step(2), (params, x, y), 3


def four_branches():
  from programs import four_branches, four_branches_args

  # A function of its own each time: jaxstreams keeps a function's traced
  # program, which the variants (sequence points off) must not share.
  def step(x, ws):
    return four_branches(x, ws)
  return step, four_branches_args(128, 256), 4


def dlrm_towers():
  from benchmarks.workloads import common, dlrm
  size = dlrm.sizes(quick=True)[0]
  fn = dlrm.make_fn(size, 4)(common.place_jaxstreams)
  params = dlrm.init(jax.random.PRNGKey(0), size)
  b = size["batch"]
  args = (params, jnp.ones((b, dlrm.DENSE)),
          jnp.zeros((size["towers"], b, size["hot"]), jnp.int32),
          jnp.ones((b,)))
  return fn, args, 4


def two_towers():
  from programs import random_inputs, two_towers
  return two_towers, tuple(random_inputs((64, 64), (64, 64), (64, 64))), 3


def one_chain():
  """Negative control: each region needs the previous one; nothing can
  overlap."""
  from programs import one_chain
  return one_chain, (jnp.ones((128, 128)), jnp.ones((128, 128))), 2


PROGRAMS = {"two_towers": two_towers, "two_tower_demo": two_tower_demo,
            "four_branches": four_branches,
            "dlrm_towers": dlrm_towers, "one_chain": one_chain}


# Variants: a program compiled another way, named "<program>/<variant>".
VARIANTS = {
    # The compiler option that lifts XLA's limit of async regions in flight
    # (jax 0.12; earlier versions do not read it for stream regions).
    "limit4": dict(compiler_options={
        "xla_gpu_experimental_parallel_async_compute_limit": 4}),
    # jaxstreams' sequence points off: what XLA makes of the regions alone.
    "unpinned": dict(sequence_points=False),
}


def schedule_of(name, target, compiler_options=None, sequence_points=True):
  fn, args, streams = PROGRAMS[name]()
  options = {"compiler_options": compiler_options} if compiler_options else {}
  # The schedule of the regions as stream calls (the default lowering is the
  # program jax.jit builds, which has none).
  jitted = jaxstreams.jit(fn, streams=streams, gpu_lowering="streams",
                          **options)
  jaxstreams.config.update("jaxstreams_sequence_points", sequence_points)
  try:
    plan = jitted.plan(*args)
    lowered = jitted.lower(*target.abstract(*args))
  finally:
    jaxstreams.config.reset("jaxstreams_sequence_points")
  barriers = lowered.as_text().count('jaxstreams_order = "1"')
  return plan, jaxstreams.xla_schedule(lowered.compile(), plan=plan), barriers


def report(name, target):
  program, _, variant = name.partition("/")
  plan, schedule, barriers = schedule_of(program, target,
                                         **VARIANTS.get(variant, {}))
  return {
      "plan_calls": [[r.index, r.stream] for r in plan.regions if r.is_call],
      "regions": [{"plan_region": r.plan_region, "stream": r.stream,
                   "main_work": len(r.main_work),
                   "overlapping": list(r.overlapping),
                   "fragment": r.fragment} for r in schedule.regions],
      "synchronous": len(schedule.synchronous),
      "peak_in_flight": schedule.peak_in_flight,
      "pairs": [[p.first, p.second, p.scheduled_together]
                for p in schedule.compare(plan)],
      "barriers": barriers,
      "summary": schedule.summary(),
      "notes": list(schedule.notes),
  }


DEFAULT = [*PROGRAMS, "four_branches/limit4", "dlrm_towers/limit4",
           "four_branches/unpinned"]


def main(names):
  target = jaxstreams.gpu_target("h100")
  print(json.dumps({name: report(name, target) for name in names or DEFAULT}))


if __name__ == "__main__":
  main(sys.argv[1:])
