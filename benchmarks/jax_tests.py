"""JAX's own tests with ``jax.jit`` swapped for ``jaxstreams.jit``.

Runs each of JAX's test files twice under the Python that runs it (a venv
with jax, pytest and jaxstreams' native runtime installed): as they are, and
with ``jax.jit`` replaced by
``jaxstreams.jit(f, streams=4, spread=True, **kw)`` (``_jit_swap.py``). It
prints and saves, per file, what passed, failed and was skipped each way,
and the tests that fail only when swapped: where a ``jaxstreams.jit``
function is not yet the ``jax.jit`` function it wraps. Tests that fail both
ways (a test file newer than the installed jax, a missing optional package)
say nothing about jaxstreams and are counted, not listed.

The test files come from a JAX source tree at the installed version
(``--jax-src``: the root of a checkout, with ``tests/``), or from a git
mirror of jax-ml/jax (``--jax-git``) at the tag ``jax-v<version>`` or the
ref given. Slow (api_test is some minutes a run): run on purpose, not by CI.

  python benchmarks/jax_tests.py --jax-git /path/to/jax.git \\
      [--ref jax-v0.10.2] [-n 2] [-k expr] [--files api_test debug_nans_test]

The results go to
``benchmarks/results/<device>/jax<version>/jax_tests_<platform>_jax<version>.json``
and ``.txt`` (``--quick``: debug_nans_test alone, ``*_quick.*``); a run of
some files (``--files``) keeps the other files' tallies from an earlier run
of the same tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import tempfile
import xml.etree.ElementTree as ElementTree

import jax

import _common

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
FILES = ("api_test", "pjit_test", "debug_nans_test", "lax_control_flow_test",
         "custom_api_test", "checkify_test", "mutable_array_test", "core_test",
         "batching_test")
# Files whose tests need several devices: XLA:CPU gives them 8.
DEVICES = {"pjit_test": 8}


def _runtime_env() -> dict[str, str]:
  """The environment of a run: this checkout's jaxstreams first on the
  path, with the native runtime of the installed jaxstreams where this
  checkout has no build of its own."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(REPO), str(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])
  own_lib = REPO / "jaxstreams" / "runtime" / "lib"
  if "JAXSTREAMS_FFI_LIB_DIR" not in env and not own_lib.is_dir():
    installed = (pathlib.Path(sysconfig.get_paths()["purelib"]) / "jaxstreams"
                 / "runtime" / "lib")
    if installed.is_dir():
      env["JAXSTREAMS_FFI_LIB_DIR"] = str(installed)
  return env


def _export(git_dir: str, ref: str, into: pathlib.Path) -> pathlib.Path:
  """The JAX source files the tests need (``tests/`` and the root's
  ``conftest.py`` and ``pyproject.toml``) at ``ref``, under ``into``."""
  paths = ["tests", "conftest.py", "pyproject.toml"]
  archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", ref,
                            *paths], check=True, capture_output=True).stdout
  into.mkdir(parents=True, exist_ok=True)
  subprocess.run(["tar", "x", "-C", str(into)], input=archive, check=True)
  return into


def _outcomes(junit: pathlib.Path) -> dict[str, str]:
  """test id -> passed / failed / skipped, from pytest's JUnit XML."""
  found = {}
  if not junit.exists():
    return found
  for case in ElementTree.parse(junit).iter("testcase"):
    name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
    kinds = {child.tag for child in case}
    if kinds & {"failure", "error"}:
      outcome = "failed"
    elif "skipped" in kinds:
      outcome = "skipped"
    else:
      outcome = "passed"
    # A teardown error after a pass is a second entry: failed wins.
    if found.get(name) != "failed":
      found[name] = outcome
  return found


def _run(src, name, swapped, args, env, scratch) -> dict[str, str]:
  junit = scratch / f"{name}_{'swapped' if swapped else 'plain'}.xml"
  command = [sys.executable, "-m", "pytest", f"tests/{name}.py", "-q", "-p",
             "no:cacheprovider", f"--junitxml={junit}", "-o",
             "junit_family=xunit1"]
  if swapped:
    command += ["-p", "_jit_swap"]
  if args.workers:
    command += ["-n", str(args.workers)]
  if args.k:
    command += ["-k", args.k]
  run_env = dict(env)
  if name in DEVICES:
    run_env["XLA_FLAGS"] = " ".join(
        [run_env.get("XLA_FLAGS", ""),
         f"--xla_force_host_platform_device_count={DEVICES[name]}"]).strip()
  result = subprocess.run(command, cwd=src, env=run_env, text=True,
                          capture_output=True)
  tail = (result.stdout + result.stderr).strip().splitlines()[-1:]
  print(f"  {name} {'swapped' if swapped else 'plain  '}: "
        f"{tail[0] if tail else '(no output)'}", flush=True)
  return _outcomes(junit)


def _earlier(path: pathlib.Path, ref: str, k: str | None) -> dict:
  """The tallies of an earlier run of the same tests (``ref``, ``-k``) saved
  at ``path``: a run of some files replaces those files' tallies and keeps
  the others'."""
  try:
    earlier = json.loads(path.read_text())
  except (OSError, ValueError):
    return {}
  if earlier.get("tests") != ref or earlier.get("k") != k:
    return {}
  return earlier.get("files", {})


def _count(outcomes: dict[str, str]) -> dict[str, int]:
  counts = {"passed": 0, "failed": 0, "skipped": 0}
  for outcome in outcomes.values():
    counts[outcome] += 1
  return counts


def tally(plain: dict[str, str], swapped: dict[str, str]) -> dict:
  """One file's counts each way and the tests that fail one way only."""
  return {
      "plain": _count(plain), "swapped": _count(swapped),
      "fail_only_swapped": sorted(
          t for t, o in swapped.items()
          if o == "failed" and plain.get(t) == "passed"),
      "fail_only_plain": sorted(
          t for t, o in plain.items()
          if o == "failed" and swapped.get(t) == "passed"),
  }


def _table(files: dict) -> str:
  lines = [f"{'file':24} {'plain pass/fail/skip':>22} "
           f"{'swapped pass/fail/skip':>24} {'only swapped':>13}"]
  for name, tally in files.items():
    p, s = tally["plain"], tally["swapped"]
    lines.append(f"{name:24} {p['passed']:>10}/{p['failed']}/{p['skipped']:<8} "
                 f"{s['passed']:>12}/{s['failed']}/{s['skipped']:<8} "
                 f"{len(tally['fail_only_swapped']):>6}")
    lines += [f"    {test}" for test in tally["fail_only_swapped"]]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = _common.parser(__doc__.split("\n\n")[0],
                          quick="debug_nans_test alone")
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--jax-src", help="a JAX source tree at the installed "
                      "version (the directory holding tests/)")
  source.add_argument("--jax-git", help="a git directory of jax-ml/jax")
  parser.add_argument("--ref", help="with --jax-git: the commit or tag "
                      "(default jax-v<installed version>)")
  parser.add_argument("--source", help="with --jax-src: what the tree is, "
                      "for the results (default: its path)")
  parser.add_argument("--files", nargs="+", default=list(FILES),
                      help="test files, without .py (default: %(default)s)")
  parser.add_argument("-n", dest="workers", type=int, default=0,
                      help="pytest-xdist workers (0: none)")
  parser.add_argument("-k", help="pytest -k expression, to focus a run")
  parser.add_argument("--streams", type=int, default=4,
                      help="the swap's stream count (default %(default)s)")
  args = parser.parse_args(argv)
  if args.quick:
    args.files = ["debug_nans_test"]

  env = _runtime_env()
  env["JAX_TESTS_SWAP_STREAMS"] = str(args.streams)
  with tempfile.TemporaryDirectory(prefix="jax_tests_") as tmp:
    scratch = pathlib.Path(tmp)
    if args.jax_src:
      src = pathlib.Path(args.jax_src).resolve()
      ref = args.source or str(src)
    else:
      ref = args.ref or f"jax-v{jax.__version__}"
      src = _export(args.jax_git, ref, scratch / "jax")
    print(f"jax {jax.__version__}, tests from {ref}", flush=True)
    result = {"machine": _common.machine(), "quiet": args.quiet,
              "tests": ref, "k": args.k,
              "swap": f"jaxstreams.jit(f, streams={args.streams}, "
                      "spread=True, **jax_jit_keywords)",
              "files": {}, "not_run": list(args.files)}
    name = (f"jax_tests_{result['machine']['platform']}_jax{jax.__version__}"
            + ("_quick" if args.quick else ""))
    earlier = _earlier(pathlib.Path(_common.out_folder(args.out))
                       / f"{name}.json", ref, args.k)
    result["files"] = {f: t for f, t in earlier.items() if f not in args.files}
    for test_file in args.files:
      plain = _run(src, test_file, False, args, env, scratch)
      swapped = _run(src, test_file, True, args, env, scratch)
      result["files"][test_file] = tally(plain, swapped)
      result["not_run"].remove(test_file)
      # Saved after each file: a run stopped early keeps what it did.
      saved = _common.save(args.out, name, result, _table(result["files"]))
  print("\n" + _table(result["files"]))
  print("saved", saved)
  return 0


if __name__ == "__main__":
  sys.exit(main())
