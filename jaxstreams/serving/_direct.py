"""A request as the caller makes it: admitted, run and counted in the
caller's thread. In direct mode it calls ``jax.jit(f)`` and waits for the
result; in grouped mode it calls the batcher (``_batching``), which returns
results already waited for.

``DirectCall`` is that request as an object: a server (or, for several
models, each model's endpoint) is one (``_server``), so that calling it is
the request, with no Python frame on the way. ``_target`` is what it calls
and ``_wait`` whether it waits for the result; both may be changed while
requests run (the by-platform choice switches a server from direct to
grouped), and a request uses the ones it read when it started. The
server's admission (``_admission``) keeps its lock, its conditions and its
policy and hands this object two callbacks for the rare ways:

* ``admit_slowly()``: a request that finds ``_admit_limit`` requests
  running (the server's ``queue_size``, or -1 once it is closing) goes the
  core's locked way, which refuses it or waits for room, and returns
  holding a token (``_take``).
* ``wake()``: called after a request ends while ``_must_wake`` is set (a
  caller waits for room, or ``close()`` for the running requests).

``_running``, ``_finished`` and ``_failed`` are the counts the core's
``stats()`` and ``close()`` read. Every name is private: they are
attributes of the server object.

There are two implementations of this one object. ``_serve_direct`` in C
(ffi/python/serve_direct.cc, built and installed with the native runtime) is
the one that runs: after each execution the interpreter's code and data have
left the CPU caches, so every Python step between a caller and ``jax.jit``
costs several times what it costs in a loop, and in Python this bookkeeping
cost a batch-1 request a measurable share of its time on CPU (see
benchmarks/README.md). ``PyDirectCall`` below does the same in Python,
slower: where the C module is not built (a source checkout run without a
build) or cannot load (a free-threaded CPython), and in the tests, which
check both.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import threading
from typing import Callable

MODULE = "_serve_direct"
MAX_SSIZE = 2**63 - 1     # the C type's limits are Py_ssize_t: no bound


class PyDirectCall:
  """The Python implementation of ``DirectCall`` (see the module docstring).

  Its counts change under a lock of its own (``+=`` on an attribute is not
  atomic); ``admit_slowly`` runs under the server's lock and takes this one
  inside it, never the other way round."""

  def __init__(self, target: Callable, array_type: type,
               block_tree: Callable, admit_slowly: Callable[[], None],
               wake: Callable[[], None]):
    self._target = target
    self._wait = True
    self._array_type = array_type
    self._block_tree = block_tree
    self._admit_slowly = admit_slowly
    self._wake = wake
    self._running = self._finished = self._failed = 0
    self._admit_limit = MAX_SSIZE
    self._must_wake = False
    self._lock = threading.Lock()

  def _take(self, limit: int) -> bool:
    with self._lock:
      if self._running >= limit:
        return False
      self._running += 1
      return True

  def _release(self) -> None:
    with self._lock:
      self._running -= 1

  def _finish(self, ok: bool) -> None:
    with self._lock:
      self._running -= 1
      self._finished += 1
      self._failed += not ok

  def __call__(self, *args, **kwargs):
    if not self._take(self._admit_limit):
      self._admit_slowly()
    ok = False
    try:
      wait = self._wait
      out = self._target(*args, **kwargs)
      if not wait:
        pass
      elif type(out) is self._array_type:
        out.block_until_ready()
      else:
        self._block_tree(out)
      ok = True
    finally:
      self._finish(ok)
      if self._must_wake:
        self._wake()
    return out


def native(search_dirs: list) -> type | None:
  """The C ``DirectCall`` from the first of ``search_dirs`` holding a build
  of it (loaded once per process), or None where there is none or it does
  not load."""
  name = f"jaxstreams.serving.{MODULE}"
  if name in sys.modules:
    return sys.modules[name].DirectCall
  for suffix in importlib.machinery.EXTENSION_SUFFIXES:
    if "abi3" not in suffix:
      continue
    for directory in search_dirs:
      path = directory / (MODULE + suffix)
      if not path.is_file():
        continue
      spec = importlib.util.spec_from_file_location(name, path)
      try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
      except ImportError:
        return None
      sys.modules[name] = module
      return module.DirectCall
  return None
