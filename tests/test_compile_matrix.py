"""Every program compiles for an H100, every way, in every call context.

Each program of ``tests/compile_matrix.py`` is compiled (without a GPU) at
top level with every ``gpu_lowering``, and inside another ``jax.jit`` and
under ``jax.grad`` with each program jaxstreams emits there (compiler
options do not reach inside another jit), and under ``jax.vmap`` by
default. Cells that hand XLA the same program are compiled once. Cells run in a
child process; a cell that crashes XLA's compiler kills that process only,
is recorded as crashed, and the cells after it run in a new one.

What must hold, on the installed jax:

* nothing crashes, and nothing fails to compile: a way asked for that XLA
  cannot compile for a region is a ``jaxstreams.LoweringError`` raised
  before compiling (``refused``), never an XLA error;
* the default never refuses: it runs such a region another way;
* every way compiles as the default's first call on a GPU would compile it
  to time it (``gpu.candidates`` picks among these per plan).

The default's cells run on every jax, but those of four suite models whose
constructs smaller programs hold (``DEFAULT_ONCE``); the other ways' cells
(``once``, see ``conftest.py``) on CI's first jax only: they are most of
the matrix's minutes, and the ways' programs are checked on every jax by
the view's tests (``test_gpu_view.py``, ``test_loops.py``,
``test_gpu_compile.py``).

Needs the CUDA plugin at jaxlib's version (see ``jaxstreams.xla.target``):
skips without it, fails instead with ``JAXSTREAMS_REQUIRE_GPU_TARGET=1``.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxstreams.lower import gpu
from programs import require_gpu_target

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compile_matrix  # noqa: E402

pytestmark = pytest.mark.slow(
    reason="each program's cells compile it for an H100 in every call "
    "context: 5 to 60 s a program on 2 cores")

# Inside another trace a way runs its nested program: jax.jit's own
# ("inline") is jax's to compile, so the matrix takes the others.
NESTED_WAYS = ("loops", "streams", "default")


def cells_of(program: str) -> list[str]:
  """The program's cells: every way at top level; inside another jit and
  under jax.grad (not of a training step), each of jaxstreams' nested
  programs and the default (only the default for a program without loops);
  under jax.vmap, the default."""
  if program in compile_matrix.FEW_CELLS:
    cells = [f"{program}/top/default", f"{program}/top/streams",
             f"{program}/jit/default"]
    if program not in compile_matrix.TRAINING_STEPS:
      cells.append(f"{program}/grad/default")
    return cells
  cells = [f"{program}/top/{way}" for way in gpu.NAMES]
  nested = (("default",) if program in compile_matrix.LOOPLESS
            else NESTED_WAYS)
  for context in ("jit", "grad"):
    if context == "grad" and program in (compile_matrix.NOT_DIFFERENTIABLE
                                         | compile_matrix.TRAINING_STEPS):
      continue
    cells += [f"{program}/{context}/{way}" for way in nested]
  return cells + [f"{program}/vmap/default"]


def run_matrix(cells: list[str]) -> dict[str, dict]:
  """The cells' results; a way refused when asked for at top level is also
  compiled as the default's first call on a GPU compiles it to time it
  (that function runs such a region in place instead)."""
  results = run_cells(cells)
  refused = [c.replace("/top/", "/candidate/") for c, r in results.items()
             if "/top/" in c and r["status"] == "refused"]
  return {**results, **(run_cells(refused) if refused else {})}


def run_cells(cells: list[str]) -> dict[str, dict]:
  """Each cell's result, compiled in child processes: a process that dies
  leaves its current cell ``crashed`` and the rest go to a new one."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  results: dict[str, dict] = {}
  todo = list(cells)
  while todo:
    proc = subprocess.run([sys.executable, str(HERE / "compile_matrix.py"),
                           *todo],
                          env=env, capture_output=True, text=True, timeout=1800)
    started = None
    for line in proc.stdout.splitlines():
      if not line.startswith("{"):
        continue
      record = json.loads(line)
      if record["status"] == "started":
        started = record["cell"]
      else:
        results[record["cell"]] = record
        started = None
    if started is None and proc.returncode != 0:
      raise AssertionError(f"the matrix child failed outside a cell "
                           f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    if started is not None:
      results[started] = {"cell": started, "status": "crashed",
                          "detail": f"exit {proc.returncode}: "
                                    f"{proc.stderr[-1500:]}"}
    todo = [c for c in todo if c not in results]
  return results


def _check(results):
  failed = {c: r for c, r in results.items()
            if r["status"] not in ("ok", "refused")}
  assert not failed, json.dumps(failed, indent=1)[:6000]
  refused_defaults = {c: r for c, r in results.items()
                      if c.endswith("/default") and r["status"] != "ok"}
  assert not refused_defaults, refused_defaults
  # What the first call on a GPU would time compiles, whatever the plan.
  candidates = {c: r for c, r in results.items() if "/candidate/" in c}
  assert all(r["status"] == "ok" for r in candidates.values()), candidates


# Suite models whose constructs the smaller programs hold, each of which
# runs on every jax: their default's cells run once (on CI's first jax).
# The dual-encoder workload's scanned towers of a training step
# (dual_encoders_train, unequal_scan_towers; its attention layers are ops,
# not a construct lowering treats apart), the GRU bank's groups of scanned
# cells (dual_encoders: many groups), the ODE ensemble's fori loops
# (fori_towers), the MLP bank's loop-free branches (demo, constant_towers).
# Their cells were a third of the matrix's minutes on each extra jax.
DEFAULT_ONCE = frozenset({"dual_encoder", "gru_bank", "ode_ensemble",
                          "mlp_bank"})


@pytest.mark.parametrize("program", [
    pytest.param(p, marks=pytest.mark.once) if p in DEFAULT_ONCE else p
    for p in sorted(compile_matrix.PROGRAMS)])
def test_the_default_compiles_in_every_context(program):
  require_gpu_target()
  _check(run_cells([c for c in cells_of(program) if c.endswith("/default")]))


@pytest.mark.once
@pytest.mark.parametrize("program", sorted(compile_matrix.PROGRAMS))
def test_every_way_compiles_or_is_refused(program):
  require_gpu_target()
  _check(run_matrix([c for c in cells_of(program)
                     if not c.endswith("/default")]))
