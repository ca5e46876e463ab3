"""XLA's own command-buffer log and thunk dump from a GPU, kept as fixtures.

On a GPU: each program of ``FIXTURES`` (from ``tests/compile_matrix.py``),
lowered as ``jaxstreams.jit`` lowers it by default, is compiled for this
machine's GPU in a child process with XLA's logging on
(``jaxstreams.xla.graph.capture(target="local")``) and XLA's text is saved to
``benchmarks/results/<device>/jax<version>/fixtures/<program>.json``, with
the device (``h100`` for the H100s the tests compare with).
``tests/test_gpu_fixtures.py`` compiles the same programs for the built-in H100
target without a GPU, on every CI run, and checks that the deviceless view finds
the same graphs and edges and the same regions side by side.

  python benchmarks/xla_fixtures.py [--out DIR] [--only scan_towers,demo]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]
# The checkout last: the installed jaxstreams (with its native libraries)
# comes first, as in the tests; a checkout that is not installed still runs.
sys.path.append(str(ROOT))

import jax  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # noqa: E402

import jaxstreams  # noqa: E402
from jaxstreams.xla import graph  # noqa: E402

# The programs and the way each is lowered: the defaults of loop towers,
# the demo step and the Inception-style model, and jax.jit's program with
# conditionals.
FIXTURES = {"scan_towers": "default", "fori_towers": "default",
            "cond_towers": "inline", "demo": "default", "inception": "default",
            "dual_encoder": "default"}


def lowered_for(name: str, way: str, args_of=lambda args: args):
  """Program ``name`` lowered ``way`` for arguments ``args_of(args)``."""
  import compile_matrix
  fn, args, streams = compile_matrix.PROGRAMS[name]()
  f = jaxstreams.jit(fn, streams=streams, gpu_lowering=way)
  return f.lower(*args_of(args))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=None,
                 help="the folder (default benchmarks/results/<device>/"
                 "jax<version>/fixtures)")
  p.add_argument("--only", default="", help="program names joined by commas")
  args = p.parse_args(argv)
  if jax.default_backend() != "gpu":
    raise SystemExit("xla_fixtures.py records a GPU's own compile: it needs "
                     "a GPU")
  jaxstreams.config.update("jaxstreams_autotune", False)
  names = args.only.split(",") if args.only else list(FIXTURES)
  folder = (pathlib.Path(args.out) if args.out else
            pathlib.Path(_common.results_folder()) / "fixtures")
  folder.mkdir(parents=True, exist_ok=True)
  for name in names:
    way = FIXTURES[name]
    texts = graph.capture(lowered_for(name, way), target="local")
    record = {"program": name, "way": way, "jax": jax.__version__,
              "device": jax.devices()[0].device_kind, **texts}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(record))
    view = graph.read_graphs(**texts)
    print(f"{name} ({way}): {view.summary().splitlines()[0]} -> {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
