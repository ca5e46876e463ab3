"""Compiles for a GPU target kept on disk (``jaxstreams_compile_cache``).

What the view's child process answers for a program compiled for a GPU
target without one (``graph.capture_all``: XLA's command-buffer log, its
thunk and buffer dumps, the compiled HLO, the memory analysis) depends only
on the program, the target, the compiler options, the XLA that compiled it
and the FFI handlers the child registered. Each answer is kept as one JSON
file named by a digest of all of those, so that a program compiled once is
read back, not compiled again: by the tests (one cache for a whole run, its
workers and child processes: ``tests/conftest.py``), by the estimate of a
returning run, by a benchmark run twice. Compiles for this machine's own
GPU (``target="local"``) are never kept: XLA autotunes them there.

Files are written whole and then renamed, so a reader never sees half of
one; a file that cannot be read or written is a miss, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import tempfile

import jax
import jaxlib

from jaxstreams import config

# Bump when what is kept changes shape.
_FORMAT = 1


def directory() -> pathlib.Path | None:
  """The directory the option names; None where it is ``none`` or empty."""
  value = config.read("jaxstreams_compile_cache")
  if not value or value.lower() == "none":
    return None
  return pathlib.Path(value).expanduser()


def key(program: dict, target_name: str, target_config: str, devices: int,
        log_modules: str) -> str:
  """The digest naming one program's answer: its module text and compiler
  options (``program``, as the child takes it), the target, the node's GPU
  count, the log asked for, the jax and jaxlib versions, and the native
  libraries whose handlers the child registers."""
  text = json.dumps([_FORMAT, program["module"],
                     sorted(program["compiler_options"].items()),
                     target_name, target_config, devices, log_modules,
                     jax.__version__, jaxlib.__version__, _libraries()])
  return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _libraries() -> tuple:
  """Name, size and modification time of each native library the child may
  load (a rebuilt library can register other handler traits, and XLA puts
  into graphs only the handlers that say they may be)."""
  from jaxstreams.runtime import _loader
  found = []
  for folder in _loader.search_dirs():
    for path in sorted(pathlib.Path(folder).glob("*.so")):
      stat = path.stat()
      found.append((path.name, stat.st_size, int(stat.st_mtime)))
  return tuple(found)


def load(name: str) -> dict | None:
  """The answer kept under ``name``, or None."""
  folder = directory()
  if folder is None:
    return None
  try:
    return json.loads((folder / f"{name}.json").read_text())
  except (OSError, ValueError):
    return None


def store(name: str, answer: dict) -> None:
  """Keep ``answer`` under ``name`` (nothing where the option is ``none``
  or the directory cannot be written)."""
  folder = directory()
  if folder is None:
    return
  try:
    folder.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".compile-")
    with os.fdopen(handle, "w") as out:
      json.dump(answer, out)
    os.replace(temporary, folder / f"{name}.json")
  except OSError:
    pass
