"""Compiles examples/sharded_training.py's step for a node of eight H100s
without one and prints, as JSON (one line), what XLA:GPU will run: per way
of writing the step (one program jax.jit partitions; shard_map), whether it
compiled with the 'streams' lowering, its async regions and its collectives
with the regions in flight beside each and the regions each waits for, and
for shard_map its body's regions and each device's CUDA graphs; and for an
FSDP-style step (tests/programs.py's gathered_towers), its collectives and
the regions in flight beside them. Run by tests/test_gpu_compile.py in a
process of its own (deviceless compilation needs JAX_PLATFORMS=cpu before
jax starts).

    JAX_PLATFORMS=cpu python tests/gpu_compile_sharded.py
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
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxstreams  # noqa: E402
from jaxstreams.xla.schedule import _reachability  # noqa: E402
import sharded_training  # noqa: E402
from programs import gathered_towers  # noqa: E402

DEVICES = 8
BATCH, FEATURES, WIDTH, TOWERS = 4096, 1024, 1024, 2


def report(step, mesh, graphs=False):
  replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  struct = lambda shape, sharding: jax.ShapeDtypeStruct(shape, jnp.float32,
                                                        sharding=sharding)
  params = {"towers": [{"w": struct((FEATURES, WIDTH), replicated),
                        "v": struct((WIDTH, 1), replicated)}
                       for _ in range(TOWERS)]}
  args = (params, struct((BATCH, FEATURES), batch), struct((BATCH, 1), batch))
  fn = jaxstreams.jit(step, streams=3, gpu_lowering="streams")
  plan = fn.plan(*args)
  # A shard_map step's regions are its body's: matched to the body's plan.
  body = next(iter(plan.bodies.values()), None)
  schedule = jaxstreams.xla_schedule(fn.lower(*args).compile(), body)
  plan_region = lambda k: schedule.regions[k].plan_region
  found = {}
  if body is not None:
    reach = _reachability(body)
    found["body_regions"] = [{"index": r.index, "stream": r.stream,
                              "reaches": sorted(reach[r.index])}
                             for r in body.regions]
  if graphs:
    # Each device's CUDA graphs, in XLA's CONCURRENT mode, and what XLA
    # leaves out of them (collectives, and regions whose window holds one).
    concurrent = jaxstreams.jit(step, streams=3,
                                gpu_lowering="streams_concurrent")
    cuda = jaxstreams.xla_graphs(concurrent.lower(*args))
    found.update({"graph_pairs": [list(p) for p in cuda.compare(body)],
                  "graph_summary": cuda.summary(),
                  "outside_graphs": [{"region": o.region, "stream": o.stream,
                                      "instruction": o.instruction}
                                     for o in cuda.outside]})
  return {**found,
      "plan_streams": sorted({r.stream for r in plan.regions}),
      "body_streams": {str(i): sorted({r.stream for r in body.regions})
                       for i, body in plan.bodies.items()},
      "gpu_reason": plan.gpu_reason,
      "regions": [{"stream": r.stream, "fragment": r.fragment,
                   "plan_region": r.plan_region} for r in schedule.regions],
      "synchronous": len(schedule.synchronous),
      "collectives": [{"name": c.name, "opcode": c.opcode,
                       "regions_in_flight": list(c.regions_in_flight),
                       # The same, as plan regions (of the shard_map body).
                       "plan_regions_in_flight": [plan_region(k) for k in
                                                  c.regions_in_flight],
                       "waits_for": [plan_region(k) for k in c.waits_for]}
                      for c in schedule.collectives],
      "summary": schedule.summary(),
  }


def gathered(mesh, placed=True):
  """programs.gathered_towers: two towers' weights all-gathered on the main
  stream, the towers on streams 1 and 2 (``placed``), or wherever spreading
  puts them."""
  step = jaxstreams.jit(gathered_towers(mesh, placed=placed), streams=3,
                        spread=not placed, gpu_lowering="streams")
  sharded = NamedSharding(mesh, P("data"))
  args = ([jax.ShapeDtypeStruct((2048, 2048), jnp.float32, sharding=sharded)
           for _ in range(2)],
          jax.ShapeDtypeStruct((4096, 2048), jnp.float32, sharding=sharded))
  schedule = jaxstreams.xla_schedule(step.lower(*args).compile())
  plan = step.plan(*args)
  return {"spread": [b.summary for b in plan.bodies.values()],
          "collectives": [{"name": c.name, "opcode": c.opcode,
                           "regions_in_flight": list(c.regions_in_flight)}
                          for c in schedule.collectives],
          "streams": sorted({r.stream for r in schedule.main_regions}),
          "summary": schedule.summary()}


def main():
  target = jaxstreams.gpu_target("h100", devices=DEVICES)
  mesh = target.make_mesh((DEVICES,), ("data",))
  print(json.dumps({
      "jit_partitioned": report(sharded_training.make_step(TOWERS, 0.05), mesh),
      "shard_map": report(sharded_training.make_shard_map_step(0.05, mesh),
                          mesh, graphs=True),
      "gathered_towers": gathered(mesh),
      "gathered_towers_spread": gathered(mesh, placed=False),
  }))


if __name__ == "__main__":
  main()
