"""The CUDA graphs XLA:GPU builds for each GPU way of the tests' programs,
compiled for an H100 on a machine without one (``jaxstreams.xla_graphs``).

No timing: the structure that decides what can run side by side. Per program
and way: the graph's kernels, longest dependency path, parallelism (kernels
over the longest path; 1.0 is one chain), and how many of the pairs of
regions the plan lets run together are side by side in the graph. Programs:
``tests/gpu_compile_programs.py`` (two towers, the demo's training step, four
branches, DLRM-style towers, one chain); ways: ``jaxstreams.lower.gpu``
forced one by one, ``jax.jit``'s own program with XLA's defaults, and
jaxstreams' default as a top-level call and inside another jit.

Needs the CUDA plugin at jaxlib's version (``jaxstreams.xla.target``).

  python benchmarks/xla_graphs.py [--quick] [--out DIR]
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]

import jax  # noqa: E402

import _common  # noqa: E402
import gpu_compile_programs as programs  # noqa: E402
import jaxstreams  # noqa: E402
from jaxstreams.lower import gpu  # noqa: E402


def graphs_of(fn, args, streams, *, way=None, nested=False, plain=False):
  if plain:
    outer = jax.jit(fn)
    plan = None
  else:
    f = jaxstreams.jit(fn, streams=streams,
                       **({"gpu_lowering": way} if way else {}))
    plan = f.plan(*args)
    outer = jax.jit(lambda *a: f(*a)) if nested else f
  lowered = outer.trace(*args).lower(lowering_platforms=("cuda",))
  graphs = jaxstreams.xla_graphs(lowered, plan=plan)
  checks = graphs.compare() if plan is not None else ()
  biggest = max(graphs.graphs, key=lambda g: len(g.kernels), default=None)
  return {
      "graphs": len(graphs.graphs), "kernels": graphs.kernels,
      "longest_path": biggest.longest_path if biggest else 0,
      "parallelism": round(graphs.parallelism, 3),
      "sequential": bool(biggest.sequential) if biggest else None,
      "outside_graphs": len(graphs.outside),
      "pairs_side_by_side": [sum(t for _, _, t in checks), len(checks)],
      "top_level_way": (plan.gpu_lowering if plan is not None and way is None
                        else way),
  }


def main():
  p = _common.parser(__doc__.splitlines()[0], "one program, two ways")
  args_ = p.parse_args()
  names = ["four_branches"] if args_.quick else list(programs.PROGRAMS)
  ways = {"jax.jit": dict(plain=True), "default": {},
          "default, inside another jit": dict(nested=True)}
  ways.update({w: dict(way=w) for w in ([] if args_.quick else gpu.WAYS)})
  if args_.quick:
    ways.pop("default, inside another jit")
  result = {"machine": _common.machine(), "target": "h100 (deviceless)",
            "programs": {}}
  lines = [f"CUDA graphs for an H100, deviceless; jax {jax.__version__}. "
           "Cells: parallelism (kernels / longest path), regions side by "
           "side / pairs the plan allows"]
  for name in names:
    fn, args, streams = programs.PROGRAMS[name]()
    rows = {way: graphs_of(fn, args, streams, **kw) for way, kw in ways.items()}
    result["programs"][name] = rows
    cells = "  ".join(
        f"{way}: {r['parallelism']:.2f}"
        + (f" ({r['pairs_side_by_side'][0]}/{r['pairs_side_by_side'][1]})"
           if r["pairs_side_by_side"][1] else "")
        for way, r in rows.items())
    lines.append(f"{name}: {cells}")
    print(lines[-1], flush=True)
  text = "\n".join(lines) + "\n"
  suffix = "_quick" if args_.quick else ""
  # Compiled for an H100 (without one): its results are the H100's.
  path = _common.save(args_.out or _common.results_folder("h100"),
                      f"xla_graphs_h100_jax{jax.__version__}{suffix}", result,
                      text)
  print("saved", path)


if __name__ == "__main__":
  main()
