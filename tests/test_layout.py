"""The package's layout, as a reader draws it from the imports.

Every ``import`` and ``from ... import`` in ``jaxstreams/**.py`` counts,
those inside functions and under ``TYPE_CHECKING`` too: a module imports
the most specific module it names (``from jaxstreams.lower import gpu``:
``jaxstreams.lower.gpu``; ``from jaxstreams.lower.gpu import NAMES``: the
same).

Floors, bottom to top. A module imports modules of its own floor and of the
floors below it, never of a floor above:

0. ``_compat``: JAX-version facts and the one place of ``jax._src`` access
   (a package: ``_compat.calls`` holds jax's calls with frontend
   attributes); it imports nothing of jaxstreams outside itself.
1. ``config``, ``_checks``, ``_performance``, ``_signature``, ``_workers``,
   ``_trace``: what every stage may use (options, argument checks, the
   warning class, argument signatures, helper threads, tracing a function).
2. ``runtime``: the native library and its ops, which lowering emits.
3. - 6. the pipeline's stages in order: ``tag`` -> ``assign`` ->
   ``partition`` -> ``lower``.
7. ``xla``: what XLA compiles and launches of the programs lowering makes,
   seen without a GPU (the view, the step-time estimate).
8. ``choose``: which way a function's calls run, weighing what lowering
   made and the view read (timing, the estimate, memory).
9. ``_pipeline``, ``_jit``, ``_jit_staged``: ``jaxstreams.jit``, which runs
   the stages on a traced function, chooses its way and lowers the plan.
10. ``staging``, ``serving``, ``_adapters``: built on ``jaxstreams.jit``
    and the programs it emits.
11. ``jaxstreams`` itself (``__init__``): the public names.

Within ``lower`` and within ``choose`` the rooms come in one direction
(``LOWER_ROOMS``, the order a plan walks them; ``CHOOSE_ROOMS``); a room
imports only rooms after it.

No import climbs a floor, lazily or not: ``EXCEPTIONS`` is empty, and
would hold each one with its reason. Beside the
floors: no circle of imports (with the package ``__init__`` files each
import of a submodule runs, but the root's, which imports every stage to
offer the public names); ``jax._src`` imported by ``_compat`` alone; no
module over ``MAX_LINES`` lines.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

# Reads only this checkout's files: the same on every jax.
pytestmark = pytest.mark.once

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxstreams"
MAX_LINES = 600

FLOORS = (
    ("_compat",),
    ("config", "_checks", "_performance", "_signature", "_workers", "_trace"),
    ("runtime",),
    ("tag",),
    ("assign",),
    ("partition",),
    ("lower",),
    ("xla",),
    ("choose",),
    ("_pipeline", "_jit", "_jit_staged"),
    ("staging", "serving", "_adapters"),
)

LOWER_ROOMS = ("memory", "gpu", "decide", "emit", "loops", "order", "packing",
               "calls", "limits")
CHOOSE_ROOMS = ("choice", "dispatch", "signature", "estimated", "compile_pool",
                "timing")

# (importer, imported) pairs allowed to climb, each with its reason in a
# comment. (config's checks of gpu_lowering and of estimate_target hold
# the names they accept themselves: tests in test_gpu_lowering.py and
# test_step_time.py hold them to the ways and to the targets.) None now.
EXCEPTIONS: set[tuple[str, str]] = set()


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in PACKAGE.rglob("*.py"):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    found[".".join(parts)] = path
  return found


MODULES = _modules()


def _imports(module: str, path: pathlib.Path) -> dict[str, int]:
  """The jaxstreams modules ``module`` imports, with the line of the first
  import of each."""
  found: dict[str, int] = {}
  package = module.split(".") if path.name == "__init__.py" else \
      module.split(".")[:-1]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package[:len(package) - node.level + 1]
        base = ".".join([*anchor, *([node.module] if node.module else [])])
      names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES
               else base for alias in node.names]
    else:
      continue
    for name in names:
      while name and name not in MODULES:
        name = name.rpartition(".")[0]
      if name and name != module:
        found.setdefault(name, node.lineno)
  return found


IMPORTS = {module: _imports(module, path) for module, path in MODULES.items()}


def _floor(module: str) -> int:
  if module == "jaxstreams":
    return len(FLOORS)
  top = module.split(".")[1]
  for level, names in enumerate(FLOORS):
    if top in names:
      return level
  raise AssertionError(
      f"{module} is on no floor: add it to FLOORS in tests/test_layout.py "
      "(and say why in the docstring)")


def _package_inits(importer: str, imported: str) -> list[str]:
  """The package ``__init__`` modules importing ``imported`` runs first:
  its packages but the root, less those ``importer`` is inside already."""
  parts = imported.split(".")
  own = importer.split(".")
  return [".".join(parts[:k]) for k in range(2, len(parts))
          if parts[:k] != own[:k]]


def test_no_circle_of_imports():
  graph = {m: set(targets) | {p for t in targets for p in _package_inits(m, t)}
           for m, targets in IMPORTS.items()}
  state: dict[str, int] = {}   # 1: on the path, 2: done
  path: list[str] = []

  def visit(module: str) -> None:
    state[module] = 1
    path.append(module)
    for target in sorted(graph[module]):
      if state.get(target) == 1:
        circle = path[path.index(target):] + [target]
        raise AssertionError("a circle of imports: " + " -> ".join(circle))
      if target not in state:
        visit(target)
    path.pop()
    state[module] = 2

  for module in sorted(graph):
    if module not in state:
      visit(module)


def _in_compat(module: str) -> bool:
  return (module == "jaxstreams._compat"
          or module.startswith("jaxstreams._compat."))


def test_compat_imports_nothing_of_jaxstreams():
  for module, targets in IMPORTS.items():
    if _in_compat(module):
      assert all(_in_compat(t) for t in targets), (module, targets)


def test_no_import_from_a_lower_floor_to_a_higher_one():
  wrong = [f"{m} (floor {_floor(m)}) imports {t} (floor {_floor(t)}) at "
           f"line {line}"
           for m, targets in sorted(IMPORTS.items())
           for t, line in sorted(targets.items())
           if _floor(t) > _floor(m) and (m, t) not in EXCEPTIONS]
  assert not wrong, "\n".join(wrong)
  stale = [pair for pair in EXCEPTIONS if pair[1] not in IMPORTS[pair[0]]]
  assert not stale, f"exceptions no import needs any more: {stale}"


@pytest.mark.parametrize("package, order", [("lower", LOWER_ROOMS),
                                            ("choose", CHOOSE_ROOMS)])
def test_rooms_are_walked_in_one_direction(package, order):
  rooms = {f"jaxstreams.{package}.{name}": k for k, name in enumerate(order)}
  unplaced = sorted(m for m in MODULES if m.startswith(f"jaxstreams.{package}.")
                    and m not in rooms)
  assert not unplaced, (f"{unplaced}: add each to {package.upper()}_ROOMS in "
                        "tests/test_layout.py, where it is walked")
  back = [f"{m} imports {t} (line {line}), a room before it"
          for m, k in rooms.items()
          for t, line in sorted(IMPORTS[m].items())
          if t in rooms and rooms[t] < k]
  assert not back, "\n".join(back)


# What decides how a program is emitted (lower/limits.py's analysis of what
# XLA compiles inside a stream call), asked once before emission by
# lower/decide.py and kept in the plan.
HAZARD_ANALYSIS = ("region_hazard", "regions_in_place", "body_hazard",
                   "carry_hazard", "carry_tail")
# What cuts a jaxpr into functions (partition/cut.py) and unpacks nested
# jaxprs and scans' counts: lower/decide.py cuts each region, equation and
# loop body before emission, and emission binds those cuts.
CUTTING = ("cut", "part_function", "part_jaxpr", "make_jaxpr",
           "nested_jaxpr", "scan_counts", "equation_jaxpr", "Packing.of")
# And what the ordering decides once for a program of stream calls.
ORDER_DECISIONS = ("collective_waits", "combiner_keys", "emitted",
                   "packed_for_collectives", "xla_stream",
                   "available_platforms")
EMISSION = ("jaxstreams.lower.emit", "jaxstreams.lower.loops")


def _named(module: str) -> set[str]:
  """The names ``module`` imports or calls (``f``, ``x.f``, and
  ``Class.method`` as such)."""
  tree = ast.parse(MODULES[module].read_text())
  named = {alias.name for node in ast.walk(tree)
           if isinstance(node, ast.ImportFrom) for alias in node.names}
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    if isinstance(node.func, ast.Name):
      named.add(node.func.id)
    elif isinstance(node.func, ast.Attribute):
      named.add(node.func.attr)
      if isinstance(node.func.value, ast.Name):
        named.add(f"{node.func.value.id}.{node.func.attr}")
  return named


@pytest.mark.parametrize("module", EMISSION)
def test_emission_decides_nothing(module):
  """Emission follows the plan's decisions (``PartitionedProgram.
  decisions``): it imports or calls none of the hazard analysis, of what
  cuts functions, or of the ordering's decisions."""
  named = _named(module) & {*HAZARD_ANALYSIS, *CUTTING, *ORDER_DECISIONS}
  assert not named, sorted(named)


def test_jax_internals_only_through_compat():
  reaching = []
  for module, path in sorted(MODULES.items()):
    if _in_compat(module):
      continue
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
      else:
        continue
      reaching += [f"{module} line {node.lineno}: {name}" for name in names
                   if name == "jax._src" or name.startswith("jax._src.")]
  assert not reaching, "\n".join(reaching)


def test_no_module_over_the_line_limit():
  long = {module: n for module, path in MODULES.items()
          if (n := len(path.read_text().splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines: {long}"
