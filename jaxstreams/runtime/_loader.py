"""Finds the native runtime libraries, loads them with ctypes and registers
their XLA FFI handlers, once per process.

The libraries are plain C-ABI shared objects (they do not link against
Python), so one build works with every Python version; they are registered
with ``jax.ffi.register_ffi_target`` from ``jax.ffi.pycapsule`` pointers. The
one extension module built with them (serve's direct-mode request) is found
in the same directories (`search_dirs`) and loaded by
jaxstreams/serving/_direct.py.

Nothing here runs at import: `load` runs on the first use of something that
needs a library (`require`, called by the runtime functions and by the
lowering rule of every runtime op, so targets are registered before XLA
compiles a program that calls them). A missing library is remembered then and
reported to whatever needed it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re
import sys
import threading
from pathlib import Path

import jax
import jaxlib

ENV_LIB_DIR = "JAXSTREAMS_FFI_LIB_DIR"

# Bumped together with JAXSTREAMS_FFI_ABI_VERSION in ffi/common/version.h, so a
# stale library from an older build is reported instead of misbehaving.
ABI_VERSION = 1

# platform (jax lowering name) -> (library file, XLA platform name, C symbol
# prefix used by the library's C API functions).
_PLATFORMS = {
  "cpu": ("libjaxstreams_cpu.so", "cpu", "JaxstreamsCpu"),
  "cuda": ("libjaxstreams_cuda.so", "CUDA", "JaxstreamsCuda"),
}

# FFI target name -> handler symbol per platform. Every target exists on both
# platforms so that one program lowers for either.
TARGETS: dict[str, dict[str, str]] = {
  name: {"cpu": f"Jaxstreams{sym}Cpu", "cuda": f"Jaxstreams{sym}Cuda"}
  for name, sym in [
    ("jaxstreams_identity", "Identity"),
    ("jaxstreams_record", "Record"),
    ("jaxstreams_wait", "Wait"),
    ("jaxstreams_delay", "Delay"),
    ("jaxstreams_marker", "Marker"),
    ("jaxstreams_stage_get", "StageGet"),
  ]
}

# Functions of the plain C API (ffi/common/capi.h) that every library exports
# as <prefix><name>; bound with ctypes in _capi.py.
CAPI_FUNCTIONS = (
  "AbiVersion",
  "FfiApiVersion",
  "PoolCreate",
  "PoolInfo",
  "PoolDestroyAll",
  "Synchronize",
  "StageCreate",
  "StagePut",
  "StageClose",
  "StageDestroy",
  "StageStats",
  "TimelineReset",
  "TimelineRead",
)


class RuntimeLibraryError(ImportError):
  """The native runtime library a platform needs is missing or unusable."""


@dataclasses.dataclass(frozen=True)
class LoadedLibrary:
  platform: str
  path: Path
  lib: ctypes.CDLL


_lock = threading.Lock()
_loaded: dict[str, LoadedLibrary] = {}
_errors: dict[str, str] = {}
_done = False


def search_dirs() -> list[Path]:
  """Directories searched for the libraries, in order.

  ``$JAXSTREAMS_FFI_LIB_DIR`` (a local CMake build's ``lib/``) replaces the
  installed package's ``jaxstreams/runtime/lib`` rather than adding to it, so
  a developer never silently runs an older installed build.
  """
  env = os.environ.get(ENV_LIB_DIR)
  if env:
    return [Path(env).expanduser()]
  return [Path(__file__).resolve().parent / "lib"]


def _how_to_build(platform: str) -> str:
  text = (
    "It is built by `pip install .` from the jaxstreams source tree "
    "(CMake, ffi/CMakeLists.txt). For a development build run "
    "`cmake -S ffi -B build/ffi -G Ninja && cmake --build build/ffi` and set "
    f"{ENV_LIB_DIR}=build/ffi/lib."
  )
  if platform == "cuda":
    text += (
      " The CUDA library is only built when a CUDA toolkit (nvcc) is found at "
      "build time and JAXSTREAMS_BUILD_CUDA is not OFF."
    )
  return text


def _how_to_rebuild() -> str:
  return (
    "Rebuild jaxstreams for the installed jaxlib: `pip install "
    "--force-reinstall --no-deps .` in the jaxstreams source tree (it "
    "compiles against FFI headers that every supported jaxlib accepts), or "
    "for a development build "
    f"`cmake -S ffi -B build/ffi -G Ninja -DPython_EXECUTABLE={sys.executable} "
    f"&& cmake --build build/ffi` and {ENV_LIB_DIR}=build/ffi/lib."
  )


def ffi_api_text(version: int) -> str:
  """``major * 1000 + minor`` (as ``<prefix>FfiApiVersion`` returns it) as
  "0.4"."""
  return f"{version // 1000}.{version % 1000}"


@functools.cache
def jaxlib_ffi_api_version() -> int | None:
  """The XLA FFI API version of the running jaxlib, ``major * 1000 + minor``,
  or None if it cannot be read.

  jaxlib ships the FFI headers of the XLA it was built from
  (``jax.ffi.include_dir()``); their ``XLA_FFI_API_MAJOR`` / ``_MINOR`` are
  the newest handler API that XLA accepts. Nothing in jax's Python API
  reports it otherwise.
  """
  header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
  try:
    text = header.read_text()
  except OSError:
    return None
  found = {}
  for part in ("MAJOR", "MINOR"):
    match = re.search(
      rf"^#define XLA_FFI_API_{part} (\d+)\s*$", text, re.MULTILINE
    )
    if match is None:
      return None
    found[part] = int(match.group(1))
  return found["MAJOR"] * 1000 + found["MINOR"]


def ffi_api_accepted(library: int, jaxlib_version: int) -> bool:
  """Whether a jaxlib of FFI API ``jaxlib_version`` accepts handlers compiled
  against ``library``: XLA takes its own major version at its own minor
  version or older (older handler versions stay supported for a year at
  least), and refuses newer ones."""
  return library // 1000 == jaxlib_version // 1000 and library <= jaxlib_version


def _check_ffi_api(path: Path, lib: ctypes.CDLL, prefix: str) -> str | None:
  """None if jaxlib accepts the library's handlers, else why not.

  jaxlib would register a too-new handler without complaint and then fail to
  start its backends ("Unable to initialize backend"), breaking every jax
  computation in the process; checked here, only the runtime is unusable.
  When jaxlib's version cannot be read, registration goes ahead as before.
  """
  version_fn = getattr(lib, f"{prefix}FfiApiVersion")
  version_fn.restype = ctypes.c_int
  version_fn.argtypes = []
  library = version_fn()
  running = jaxlib_ffi_api_version()
  if running is None or ffi_api_accepted(library, running):
    return None
  return (
    f"jaxstreams: {path} was compiled against XLA FFI API "
    f"{ffi_api_text(library)}, but the installed jaxlib {jaxlib.__version__} "
    f"has XLA FFI API {ffi_api_text(running)} and refuses handlers of a newer "
    f"or another major version. Its handlers were not registered. "
    f"{_how_to_rebuild()}"
  )


def _load_platform(platform: str, dirs: list[Path]) -> LoadedLibrary | str:
  """Loads one platform's library from `dirs` and registers its handlers.

  Returns the loaded library or a message saying why it is not usable.
  """
  filename, xla_platform, prefix = _PLATFORMS[platform]
  candidates = [d / filename for d in dirs]
  path = next((p for p in candidates if p.is_file()), None)
  if path is None:
    searched = ", ".join(str(p) for p in candidates)
    return (
      f"jaxstreams: the {platform.upper()} runtime library {filename} was not "
      f"found (searched: {searched}). {_how_to_build(platform)}"
    )
  try:
    lib = ctypes.CDLL(str(path))
  except OSError as e:
    return f"jaxstreams: could not load {path}: {e}. {_how_to_build(platform)}"
  try:
    version_fn = getattr(lib, f"{prefix}AbiVersion")
  except AttributeError:
    version_fn = None
  if version_fn is not None:
    version_fn.restype = ctypes.c_int
    version_fn.argtypes = []
    version = version_fn()
  else:
    version = None
  if version != ABI_VERSION:
    return (
      f"jaxstreams: {path} has runtime ABI version {version}, this Python "
      f"package expects {ABI_VERSION}; the library is from another build. "
      f"{_how_to_build(platform)}"
    )
  for name in CAPI_FUNCTIONS:
    if not hasattr(lib, prefix + name):
      return (
        f"jaxstreams: {path} does not export the C API function "
        f"{prefix}{name}; the library is from another build. "
        f"{_how_to_build(platform)}"
      )
  ffi_problem = _check_ffi_api(path, lib, prefix)
  if ffi_problem is not None:
    return ffi_problem
  capsules = {}
  for target, symbols in TARGETS.items():
    symbol = symbols[platform]
    try:
      capsules[target] = jax.ffi.pycapsule(getattr(lib, symbol))
    except AttributeError:
      return (
        f"jaxstreams: {path} does not export the handler {symbol} for "
        f"target {target!r}; the library is from another build. "
        f"{_how_to_build(platform)}"
      )
  for target, capsule in capsules.items():
    jax.ffi.register_ffi_target(target, capsule, platform=xla_platform)
  return LoadedLibrary(platform, path, lib)


def load() -> None:
  """Loads and registers every platform's library; later calls do nothing."""
  global _done
  with _lock:
    if _done:
      return
    dirs = search_dirs()
    for platform in _PLATFORMS:
      result = _load_platform(platform, dirs)
      if isinstance(result, LoadedLibrary):
        _loaded[platform] = result
      else:
        _errors[platform] = result
    _done = True


def available_platforms() -> tuple[str, ...]:
  """The platforms ("cpu", "cuda") whose runtime library loaded."""
  load()
  return tuple(p for p in _PLATFORMS if p in _loaded)


def require(platform: str) -> LoadedLibrary:
  """The loaded library for `platform`, or RuntimeLibraryError saying why
  not."""
  load()
  if platform not in _PLATFORMS:
    raise RuntimeLibraryError(
      f"jaxstreams: the native runtime supports platforms "
      f"{sorted(_PLATFORMS)}, not {platform!r}"
    )
  loaded = _loaded.get(platform)
  if loaded is None:
    raise RuntimeLibraryError(_errors[platform])
  return loaded


def library_path(platform: str) -> Path | None:
  """Where `platform`'s library was loaded from, or None."""
  load()
  loaded = _loaded.get(platform)
  return loaded.path if loaded else None
