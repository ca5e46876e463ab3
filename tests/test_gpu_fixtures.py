"""The deviceless view against a GPU's own compile.

``benchmarks/xla_fixtures.py``, run on a GPU (``scripts/gpu_session.sh
fixtures``), keeps XLA's command-buffer log and thunk dump of the programs
it lists, per jax version, in
``benchmarks/results/h100/jax<version>/fixtures``. Here each
is read back, and the same program compiled for the built-in H100 target
without a GPU must give the same graphs (commands and edges) and the same
regions side by side. Where no GPU has recorded fixtures for the installed
jax, the tests say so and skip; the CUDA plugin is needed as for every
deviceless compile.
"""

import json
import pathlib
import sys

import jax
import pytest

from programs import require_gpu_target

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDER = (ROOT / "benchmarks" / "results" / "h100" / f"jax{jax.__version__}"
          / "fixtures")
FILES = sorted(FOLDER.glob("*.json")) if FOLDER.is_dir() else []


def _shape(view):
  return [(len(g.kernels), sorted(g.edges)) for g in view.graphs]


@pytest.mark.skipif(not FILES, reason=f"no fixtures from a GPU for jax "
                    f"{jax.__version__} yet (scripts/gpu_session.sh fixtures "
                    "records them)")
@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_the_deviceless_view_matches_the_gpu(path):
  require_gpu_target()
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import xla_fixtures
  import jaxstreams
  from jaxstreams.xla import graph
  record = json.loads(path.read_text())
  on_gpu = graph.read_graphs(**{k: record[k] for k in (
      "log", "sequence", "metadata", "hlo", "buffers")})
  target = jaxstreams.gpu_target("h100")
  lowered = xla_fixtures.lowered_for(record["program"], record["way"],
                                     lambda args: target.abstract(*args))
  here = jaxstreams.xla_graphs(lowered, target=target)
  assert _shape(here) == _shape(on_gpu), (here.summary(), on_gpu.summary())
  assert here.parallel_regions() == on_gpu.parallel_regions()
  assert len(here.loops) == len(on_gpu.loops)
