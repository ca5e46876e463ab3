"""The jaxstreams native runtime: XLA FFI handlers for CPU and CUDA.

The handlers live in two C-ABI shared libraries built from ``ffi/``
(``libjaxstreams_cpu.so`` always, ``libjaxstreams_cuda.so`` when a CUDA toolkit
was found at build time). Importing this module loads nothing: the first use
of something that needs a library (a runtime function, a ``StageArea``, or
lowering a program that contains a runtime op) loads whichever of them is
present and registers their targets with XLA, once. A missing library is
reported then, as :class:`RuntimeLibraryError` saying what is missing and how
to build it.

Set ``JAXSTREAMS_FFI_LIB_DIR`` to a local CMake build's ``lib/`` directory to
use it instead of the installed libraries.

What it offers, on CPU (worker threads, host memory, steady clock) and CUDA
(streams, events, pinned and device memory) alike:

- ``init()``: per-device pools of runtime streams and events, created once.
- ``record`` / ``wait``: explicit events between XLA's stream and the
  runtime's streams; ``delay``: a slow task on a stream (tests, demos).
- ``StageArea``: fixed-capacity slots with ready events, a copy stream, and a
  consumer op that takes the next ready slot inside a jitted step.
- ``marker`` and ``timeline``: per-region timestamps and a Chrome-trace /
  Perfetto JSON timeline with one track per stream.
"""

from jaxstreams.runtime import timeline
from jaxstreams.runtime._capi import (
  RuntimeOpError,
  StageClosedError,
  StageTimeoutError,
)
from jaxstreams.runtime._loader import (
  ENV_LIB_DIR,
  RuntimeLibraryError,
  available_platforms,
  library_path,
)
from jaxstreams.runtime._ops import (
  BEGIN,
  CALLER,
  END,
  INSTANT,
  delay,
  identity,
  marker,
  record,
  wait,
)
from jaxstreams.runtime._pool import (
  PoolConfig,
  allocate_event,
  config,
  init,
  release_event,
  shutdown,
  synchronize,
)
from jaxstreams.runtime.stage import StageArea, StageStats


__all__ = [
  "BEGIN",
  "CALLER",
  "END",
  "ENV_LIB_DIR",
  "INSTANT",
  "PoolConfig",
  "RuntimeLibraryError",
  "RuntimeOpError",
  "StageArea",
  "StageClosedError",
  "StageStats",
  "StageTimeoutError",
  "allocate_event",
  "available_platforms",
  "config",
  "delay",
  "identity",
  "init",
  "library_path",
  "marker",
  "record",
  "release_event",
  "shutdown",
  "synchronize",
  "timeline",
  "wait",
]
