"""``jaxstreams.serve``: a request batcher whose batches run on stream groups.

Two ways to run a request, chosen by ``mode`` (see ``serve``):

* *direct*: the caller's own thread calls ``jax.jit(f)``, exactly what a
  plain thread would do: no hand-off, no batching program. The request is
  a ``DirectCall`` object (_direct.py; in C where it was built) that
  counts it and admits it without a lock.
  ``mode="by_platform"`` picks it, from the platform and ``groups`` alone
  (nothing is measured), where stream groups cannot pay: a platform that
  runs one stream (XLA:CPU), ``groups=1``, and every GPU measured so far (an
  H100 with jax 0.11.2, where grouped requests lost at every thread count).
  Being no slower than doing without comes first: a batch of requests on
  XLA:CPU runs them one after another anyway, after two thread hand-offs
  they did not need.
* *grouped*: the request path below.

How a grouped request travels, and why each step is there:

1. ``submit`` puts it on a bounded queue (back-pressure: a full queue blocks
   the caller or raises ``QueueFullError``) and returns a ``Future``.
2. The *dispatch* thread takes up to ``groups`` queued requests. It never
   waits while nothing is running (an idle device should not idle longer);
   while a batch is running it waits up to ``max_batch_wait_ms`` for more,
   so that under load requests arrive together and share an execution.
   (A synchronous call that finds nothing running or queued skips the
   queue and runs in the caller's thread: two thread hand-offs would cost a
   lone small request more than its execution.)
3. Each request's *signature* (pytree structure, and shape, dtype and weak
   type of each leaf) is traced once: ``f`` becomes a jaxpr. A Python
   exception raised by ``f`` here reaches that request's caller and nobody
   else: the request leaves the batch before the batch is built.
4. The batch runs as one call of a ``jaxstreams.jit`` program made for its
   combination of signatures (an LRU cache of ``max_programs`` programs).
   Batch slot ``r`` runs on stream group ``r``, which is compute stream
   ``r + 1`` of a ``streams=groups + 1`` program: every request is an
   annotated region of its own (k requests, k distinct stream annotations),
   and stream 0, the main stream, only passes results through.
5. The *completion* thread waits for the batch's results and hands each
   caller its own. If the batched execution fails (compile or run time),
   the requests of that batch are run again one by one, so that each caller
   gets its own result or its own error.

Each request's whole computation is one opaque equation (the
``jaxstreams_serve_request`` primitive) placed in its group's
``jaxstreams.stream`` block. That is what *flattens* any ``stream()`` blocks
inside ``f``: the planner sees one equation per request, so the request runs
whole on its group's stream, whatever ids ``f`` names (they are not even
range-checked against ``groups``). Keeping them would need streams per
group, which XLA:GPU does not have: a group is one compute stream.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import numbers
import queue
import threading
import time
import weakref
from typing import Any, Callable

import jax
import jax.extend.core as jcore
from jax import tree_util
from jax.interpreters import mlir

from jaxstreams import _checks, _compat, _workers
from jaxstreams.runtime import _loader
from jaxstreams.serving import _direct
from jaxstreams._jit import jit as _streams_jit, spec_of
from jaxstreams._signature import signature as _leaf_signatures, traced_signature
from jaxstreams._trace import trace
from jaxstreams.partition.cut import part_jaxpr
from jaxstreams.tag import stream as _stream

__all__ = ["QueueFullError", "ServeStats", "Server", "ServerClosedError",
           "serve"]


class ServerClosedError(RuntimeError):
  """A request was submitted to a server that is closed or closing."""


class QueueFullError(queue.Full):
  """The request queue is full and the server was made with ``block=False``
  (or the ``block`` timeout ran out). A ``queue.Full``, so code that already
  catches that keeps working."""


# ---------------------------------------------------------------------------
# One request's computation as one equation.

class _Traced:
  """``f`` traced for one request signature. Identity-hashed, so that it can
  be a primitive parameter, and opaque to the planner: the jaxpr sits in an
  attribute, where ``jaxprs_in_params`` does not look, so tags inside ``f``
  are invisible and the request is placed whole."""

  __slots__ = ("closed", "consts", "out_tree", "__weakref__")

  def __init__(self, closed, out_tree):
    # The constants f closes over (model weights, typically) become leading
    # operands rather than constants baked into each request's code: the k
    # requests of a batch then share one copy of them instead of k.
    jaxpr = closed.jaxpr
    self.closed = part_jaxpr([*jaxpr.constvars, *jaxpr.invars], jaxpr.outvars,
                             jaxpr.eqns)
    self.consts = list(closed.consts)
    self.out_tree = out_tree

  def __repr__(self) -> str:
    return f"<served request: {len(self.closed.jaxpr.eqns)} equations>"


_request_p = jcore.Primitive("jaxstreams_serve_request")
_request_p.multiple_results = True


@_request_p.def_impl
def _request_impl(*args, traced: _Traced):
  return jcore.jaxpr_as_fun(traced.closed)(*args)


@_request_p.def_effectful_abstract_eval
def _request_abstract_eval(*avals, traced: _Traced):
  del avals
  return traced.closed.out_avals, traced.closed.effects


def _request_lowering(ctx, *args, traced: _Traced):
  # Inline: the program XLA gets for a request is the one jax.jit(f) gives,
  # inside the request's region call, so results are jax.jit's.
  return mlir.lower_fun(jcore.jaxpr_as_fun(traced.closed),
                        multiple_results=True)(ctx, *args)


mlir.register_lowering(_request_p, _request_lowering)


def _signature(request) -> tuple:
  """What decides the traced program: the pytree structure and each leaf's
  shape, dtype, weak type and sharding (``jaxstreams._signature``). Raises TypeError
  for a leaf jax.jit would refuse."""
  leaves, treedef = tree_util.tree_flatten(request)
  return treedef, _leaf_signatures(leaves)


# ---------------------------------------------------------------------------
# Requests, stats, the LRU.

@dataclasses.dataclass
class _Request:
  payload: tuple                          # (args, kwargs)
  future: concurrent.futures.Future
  signature: tuple | None = None


@dataclasses.dataclass(frozen=True)
class ServeStats:
  """Counters of a server, for tests and monitoring (not timings).

  ``signatures_traced``: times ``f`` was traced (once per request signature
  while cached). ``programs_traced``: batched programs traced (once per
  combination of signatures while cached). ``batch_sizes``: requests per
  execution -> number of executions. ``fallbacks``: batches rerun one by
  one after a failed execution. ``mode``: how requests run, ``"direct"``
  (each in its caller's thread as ``jax.jit(f)``) or ``"grouped"``;
  ``mode_reason`` says why. ``direct``: requests run as plain ``jax.jit(f)``
  calls in their caller's thread (in direct mode; 0 in grouped mode).
  """
  requests: int
  completed: int
  failed: int
  batches: int
  batch_sizes: dict[int, int]
  signatures_traced: int
  programs_traced: int
  programs_cached: int
  program_evictions: int
  fallbacks: int
  mode: str = "grouped"
  mode_reason: str = ""
  direct: int = 0


class _LRU:
  def __init__(self, bound: int):
    self.bound = bound
    self.items: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    self.evictions = 0

  def get(self, key):
    value = self.items.get(key)
    if value is not None:
      self.items.move_to_end(key)
    return value

  def put(self, key, value) -> None:
    self.items[key] = value
    self.items.move_to_end(key)
    while len(self.items) > self.bound:
      self.items.popitem(last=False)
      self.evictions += 1


# ---------------------------------------------------------------------------
# Direct or grouped.

MODES = ("by_platform", "direct", "grouped")


def _platform() -> str:
  """The platform requests run on (a function, so tests can pretend)."""
  return jax.default_backend()


def _resolve_mode(mode: str, groups: int) -> tuple[str, str]:
  """``(mode, why)``: ``"direct"`` where stream groups cannot pay, which so
  far is everywhere it was measured."""
  if mode != "by_platform":
    return mode, f"mode={mode!r} was asked for"
  platform = _platform()
  if platform == "cpu":
    return "direct", ("XLA:CPU runs one stream: grouped requests would run "
                      "one after another anyway, after two thread hand-offs")
  if groups == 1:
    return "direct", "groups=1: no two requests can run side by side"
  return "direct", (f"on {platform} grouped requests measured slower than "
                    "threads calling jax.jit (an H100, jax 0.11.2: 0.36x-0.53x "
                    "of their throughput at 4 to 64 threads); "
                    "mode='grouped' runs them grouped")


# ---------------------------------------------------------------------------
# The server's state, shared by the server object and its threads.

_MAX_IN_FLIGHT = 2      # batches dispatched and not yet handed back
_server_ids = itertools.count(1)
THREAD_PREFIX = "jaxstreams-serve"


class _Core:
  """Everything the worker threads need. The threads hold this, never the
  ``Server``, so dropping the last ``Server`` reference lets it be collected,
  and its finalizer closes this core and the threads end."""

  def __init__(self, fun: Callable, groups: int, wait_s: float,
               queue_size: int | None, block: bool | float,
               max_programs: int, name: str, mode: str = "grouped"):
    self.fun = fun
    self.mode, self.mode_reason = _resolve_mode(mode, groups)
    self.jitted = jax.jit(fun)
    self.groups = groups
    self.wait_s = wait_s
    self.queue_size = queue_size
    self.block = block
    self.name = name
    self.lock = threading.Lock()
    self.work = threading.Condition(self.lock)     # queue grew / batch done
    self.space = threading.Condition(self.lock)    # queue shrank / closing
    self.pending: collections.deque[_Request] = collections.deque()
    self.in_flight = 0           # grouped: batches (and lone requests) running
    self.space_waiters = 0       # callers blocked in _wait_for_space
    # Direct mode: a request admitted at once takes no lock; the DirectCall
    # object (_direct.py) counts it. The lock only on the way of a refusal,
    # a wait for room, or a close.
    self.limit = _direct.MAX_SSIZE if queue_size is None else queue_size
    self.direct = self.mode == "direct"
    # Direct mode's server object, a DirectCall (set by _make_server). Its
    # _admit_limit: the most requests admitted without the lock (-1 once
    # closing, so that every request takes the locked way and is refused
    # there); its _must_wake: whether a request that ends must wake a
    # caller waiting for room or a close() waiting for the running ones.
    self.direct_call = None
    self.closing = False
    self.workers = _workers.Workers(name)
    self.done: queue.SimpleQueue = queue.SimpleQueue()
    # Caches, guarded by their own lock (tracing happens under it).
    self.cache_lock = threading.RLock()
    self.traced = _LRU(max_programs * groups)
    self.programs = _LRU(max_programs)
    self.counts = collections.Counter()
    self.batch_sizes: collections.Counter[int] = collections.Counter()

  # -- submission ------------------------------------------------------------

  def submit(self, payload: tuple) -> concurrent.futures.Future:
    if self.mode == "direct":
      return self._submit_direct(payload)
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self.lock:
      self._check_open()
      if self.queue_size is not None and len(self.pending) >= self.queue_size:
        self._wait_for_space(lambda: len(self.pending) >= self.queue_size)
      self.pending.append(_Request(payload, future))
      self.counts["requests"] += 1
      if not self.workers.threads:
        self.workers.start("dispatch", self._dispatch_loop)
        self.workers.start("complete", self._complete_loop)
      self.work.notify_all()
    return future

  def _check_open(self) -> None:
    if self.closing:
      raise ServerClosedError(
          f"{self.name} is closed: it finishes the requests it had queued and "
          "takes no new ones. Make a new server with jaxstreams.serve(...).")

  def _wait_for_space(self, full: Callable[[], bool]) -> None:
    """Back-pressure (called holding the lock while ``full()``): wait for
    room as ``block`` says, or raise QueueFullError."""
    if self.block is False:
      raise QueueFullError(
          f"{self.name}: {self._full_what('is')} and the server was made "
          "with block=False. Retry later, or make it with a larger "
          "queue_size or block=True.")
    deadline = None if self.block is True else time.monotonic() + self.block
    self.space_waiters += 1
    self._set_must_wake(True)
    try:
      while full() and not self.closing:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
          raise QueueFullError(
              f"{self.name}: {self._full_what('stayed')} for "
              f"block={self.block} seconds.")
        self.space.wait(remaining)
    finally:
      self.space_waiters -= 1
      self._set_must_wake(self.space_waiters > 0 or self.closing)
    self._check_open()

  def _set_must_wake(self, value: bool) -> None:
    if self.direct_call is not None:
      self.direct_call._must_wake = value

  def _full_what(self, verb: str) -> str:
    """What is full, truthfully per mode: in direct mode no request waits in
    a queue, the callers' own threads run them, ``queue_size`` at most."""
    if self.mode == "direct":
      requests = "request" if self.queue_size == 1 else "requests"
      return (f"the server {verb} at its limit of {self.queue_size} {requests} "
              "running at once (direct mode: queue_size bounds the requests "
              "in flight in their callers' threads)")
    return (f"the request queue {verb} full ({self.queue_size} requests "
            "waiting)")

  # -- direct mode: the caller's thread runs jax.jit(f) --------------------
  # A call is the server object, a DirectCall (see _direct.py); these are
  # its slow ways and submit().

  def _admit_slowly(self) -> None:
    """A direct request that found the server closing or full: refuse it,
    or wait for room as ``block`` says; on return it holds its token."""
    with self.lock:
      self._check_open()
      taken = self.direct_call._take(self.limit)
      if taken:
        return

      def full() -> bool:
        nonlocal taken
        taken = self.direct_call._take(self.limit)
        return not taken

      try:
        self._wait_for_space(full)
      except BaseException:
        if taken:               # room came, and so did a close
          self.direct_call._release()
        raise

  def _wake(self) -> None:
    """A direct request ended while callers wait for room or close() waits
    for the running ones."""
    with self.lock:
      self.space.notify_all()
      self.work.notify_all()

  def _submit_direct(self, payload: tuple) -> concurrent.futures.Future:
    # Dispatched in the caller's thread as jax.jit would be; the future is
    # settled on return and holds jax.jit's (asynchronously computed)
    # result or the caller's own error.
    args, kwargs = payload
    direct = self.direct_call
    if not direct._take(direct._admit_limit):
      self._admit_slowly()
    future: concurrent.futures.Future = concurrent.futures.Future()
    ok = False
    try:
      future.set_result(self.jitted(*args, **kwargs))
      ok = True
    except Exception as e:  # noqa: BLE001 -- this caller's own error
      future.set_exception(e)
    finally:
      direct._finish(ok)
      if direct._must_wake:
        self._wake()
    return future

  # -- closing ---------------------------------------------------------------

  def close(self, join: bool, timeout: float | None) -> bool:
    with self.lock:
      self.closing = True
      if self.direct_call is not None:
        self.direct_call._admit_limit = -1
      self._set_must_wake(True)
      self.work.notify_all()
      self.space.notify_all()
    if not join:
      return True
    deadline = None if timeout is None else time.monotonic() + timeout
    if self.mode == "direct":
      with self.lock:   # drain: wait for the requests running in callers
        while self.direct_call._running:
          remaining = None if deadline is None else deadline - time.monotonic()
          if remaining is not None and remaining <= 0:
            return False
          self.work.wait(remaining)
      return True
    return self.workers.join(timeout)

  # -- the dispatch thread ---------------------------------------------------

  def _take_batch(self) -> list[_Request] | None:
    with self.lock:
      while not self.pending and not self.closing:
        self.work.wait()
      if not self.pending:
        return None                                   # closing and drained
      deadline = time.monotonic() + self.wait_s
      while True:
        now = time.monotonic()
        can_run = self.in_flight < _MAX_IN_FLIGHT
        if can_run and (len(self.pending) >= self.groups or self.closing
                        or self.in_flight == 0 or now >= deadline):
          break
        self.work.wait(deadline - now if can_run and now < deadline else 0.05)
      batch = [self.pending.popleft()
               for _ in range(min(self.groups, len(self.pending)))]
      self.in_flight += 1
      self.space.notify_all()
    return [r for r in batch if r.future.set_running_or_notify_cancel()]

  def _dispatch_loop(self) -> None:
    while True:
      batch = self._take_batch()
      if batch is None:
        self.done.put(None)
        return
      try:
        self.done.put(self._dispatch(batch))
      except BaseException as e:  # a bug of ours: fail the batch, keep serving
        for request in batch:
          if not request.future.done():
            self._fail(request, e)
        self.done.put(([], None))

  def call_grouped(self, *args, **kwargs):
    """A synchronous request. When nothing is running or queued, the caller's
    own thread runs it (a batch of one), skipping two thread hand-offs that
    would cost a lone request more than its execution; otherwise it queues
    and joins the next batch like any other."""
    payload = (args, kwargs)
    with self.lock:
      inline = (not self.closing and not self.pending
                and self.in_flight == 0)
      if inline:
        self.in_flight += 1
        self.counts["requests"] += 1
    if not inline:
      return self.submit(payload).result()
    request = _Request(payload, concurrent.futures.Future())
    request.future.set_running_or_notify_cancel()
    try:
      runnable, outputs = self._dispatch([request])
      if runnable:
        self._settle(runnable, outputs)
    finally:
      with self.lock:
        self.in_flight -= 1
        self.work.notify_all()
    return request.future.result()

  def _dispatch(self, batch: list[_Request]) -> tuple[list[_Request], Any]:
    """Trace what is new, and start one execution for the batch. Returns
    the requests in the execution and its outputs (or its exception)."""
    runnable = []
    for request in batch:
      try:
        request.signature = _signature(request.payload)
        self.traced_for(request.signature)   # f's own trace errors: here
      except BaseException as e:  # noqa: BLE001 -- this caller's error, even a
        # KeyboardInterrupt raised by f: it must not fail the rest of the batch
        self._fail(request, e)
        continue
      runnable.append(request)
    if not runnable:
      return [], None
    try:
      fn = self.program_for(tuple(r.signature for r in runnable))
      outputs = fn(*(r.payload for r in runnable))
    except Exception as e:  # noqa: BLE001 -- settled per request later
      outputs = e
    return runnable, outputs

  # -- the completion thread -------------------------------------------------

  def _complete_loop(self) -> None:
    while True:
      item = self.done.get()
      if item is None:
        return
      batch, outputs = item
      try:
        if batch:
          self._settle(batch, outputs)
      finally:
        with self.lock:
          self.in_flight -= 1
          self.work.notify_all()

  def _settle(self, batch: list[_Request], outputs) -> None:
    if not isinstance(outputs, Exception):
      try:
        jax.block_until_ready(outputs)
      except Exception as e:  # noqa: BLE001
        outputs = e
    with self.lock:                 # one lock for the batch's counts
      self.counts["batches"] += 1
      self.batch_sizes[len(batch)] += 1
      if not isinstance(outputs, Exception):
        self.counts["completed"] += len(batch)
    if not isinstance(outputs, Exception):
      for request, output in zip(batch, outputs):
        request.future.set_result(output)
      return
    if len(batch) == 1:
      self._fail(batch[0], outputs)
      return
    # One request (or the combination) broke the execution: rerun each alone
    # so that each caller gets its own result or its own error.
    with self.lock:
      self.counts["fallbacks"] += 1
    for request in batch:
      try:
        (output,) = self.program_for((request.signature,))(request.payload)
        jax.block_until_ready(output)
      except Exception as e:  # noqa: BLE001
        self._fail(request, e)
      else:
        self._succeed(request, output)

  def _succeed(self, request: _Request, output) -> None:
    with self.lock:
      self.counts["completed"] += 1
    request.future.set_result(output)

  def _fail(self, request: _Request, error: BaseException) -> None:
    with self.lock:
      self.counts["failed"] += 1
    request.future.set_exception(error)

  # -- programs --------------------------------------------------------------

  def traced_for(self, signature: tuple) -> _Traced:
    """``f`` traced for one request signature (cached)."""
    with self.cache_lock:
      traced = self.traced.get(signature)
      if traced is not None:
        return traced
      treedef, avals = signature
      args, kwargs = tree_util.tree_unflatten(
          treedef, [leaf.struct() for leaf in avals])
      self.counts["signatures_traced"] += 1
      closed, _, out_tree = trace(self.fun, args, kwargs)
      traced = _Traced(closed, out_tree)
      self.traced.put(signature, traced)
      return traced

  def batch_function(self, counted: bool = False):
    """A fresh ``jaxstreams.jit`` function of ``*requests`` (each an
    ``(args, kwargs)`` pair) that runs request ``r`` on stream group ``r``.
    Fresh, so that evicting it from the LRU frees what jax.jit keeps for it."""
    core_ref = weakref.ref(self)
    groups = self.groups

    def run_batch(*requests):
      core = core_ref()
      if len(requests) > groups:
        raise ValueError(f"a batch holds at most groups={groups} requests, "
                         f"got {len(requests)}")
      if counted:
        with core.cache_lock:
          core.counts["programs_traced"] += 1
      results = []
      for slot, request in enumerate(requests):
        leaves, _ = tree_util.tree_flatten(request)
        traced = core.traced_for(_signature_of_traced(request))
        with _stream(slot + 1):
          out = _request_p.bind(*traced.consts, *leaves, traced=traced)
        results.append(tree_util.tree_unflatten(traced.out_tree, out))
      return tuple(results)

    run_batch.__name__ = run_batch.__qualname__ = f"serve_{_name(self.fun)}"
    # The groups are regions: they run the way jaxstreams_gpu_lowering says,
    # side by side in XLA's CUDA graph by default (jaxstreams.lower.gpu).
    return _streams_jit(run_batch, streams=groups + 1)

  def program_for(self, key: tuple):
    with self.cache_lock:
      fn = self.programs.get(key)
      if fn is None:
        fn = self.batch_function(counted=True)
        self.programs.put(key, fn)
      return fn

  def stats(self) -> ServeStats:
    with self.lock, self.cache_lock:
      c = self.counts
      d = self.direct_call
      finished, failed, running = ((d._finished, d._failed, d._running)
                                   if d is not None else (0, 0, 0))
      direct = finished + running                # direct mode's requests
      return ServeStats(
          requests=c["requests"] + direct,
          completed=c["completed"] + finished - failed,
          failed=c["failed"] + failed,
          batches=c["batches"], batch_sizes=dict(sorted(self.batch_sizes.items())),
          signatures_traced=c["signatures_traced"],
          programs_traced=c["programs_traced"],
          programs_cached=len(self.programs.items),
          program_evictions=self.programs.evictions,
          fallbacks=c["fallbacks"], mode=self.mode,
          mode_reason=self.mode_reason,
          direct=direct)


_ARRAY_TYPE = _compat.ARRAY_TYPE


@functools.cache
def _direct_call_type() -> type:
  """The C ``DirectCall`` where it was built with the native runtime, else
  the Python one (see _direct.py)."""
  return _direct.native(_loader.search_dirs()) or _direct.PyDirectCall


def _signature_of_traced(request) -> tuple:
  """``_signature`` of a request whose leaves are tracers of the batch trace
  (their avals are the concrete requests' avals)."""
  leaves, treedef = tree_util.tree_flatten(request)
  return treedef, traced_signature(leaves)


def _name(fun) -> str:
  return getattr(fun, "__name__", None) or type(fun).__name__


# ---------------------------------------------------------------------------
# The public object.

class Server:
  """A thread-safe callable serving ``f``; made by ``jaxstreams.serve``.

  ``server(*args, **kwargs)`` waits for and returns ``f(*args, **kwargs)``,
  run with whatever requests arrive with it (in grouped mode; with none
  running or queued, it runs at once in the calling thread);
  ``server.submit(...)`` returns a ``concurrent.futures.Future`` instead.
  Use it as a context manager, or call ``close()``: the queued requests are
  finished, new ones raise ``ServerClosedError``, and the worker threads
  end. The threads also end when the server is garbage-collected.

  No ``__call__`` here, and no Python frame on the way of a request: a
  direct-mode server is also a ``DirectCall`` (_direct.py), whose call is
  the request; a grouped one is a ``functools.partial`` of
  ``call_grouped`` (see ``_make_server``).
  """

  def submit(self, *args, **kwargs) -> concurrent.futures.Future:
    """Queue ``f(*args, **kwargs)``; the future holds its result or error.

    Raises ``ServerClosedError`` once the server is closing, and
    ``QueueFullError`` when the queue is full and the server does not block.
    """
    return self._core.submit((args, kwargs))

  def close(self, timeout: float | None = None) -> bool:
    """Refuse new requests, finish the queued ones, and stop the threads.

    Waits up to ``timeout`` seconds (``None``: until done) and returns
    whether the threads have ended. Calling it again is harmless.
    """
    return self._core.close(True, timeout)

  @property
  def closed(self) -> bool:
    return self._core.closing

  @property
  def groups(self) -> int:
    return self._core.groups

  @property
  def mode(self) -> str:
    """How requests run: ``"direct"`` or ``"grouped"`` (``stats()``'s
    ``mode_reason`` says why)."""
    return self._core.mode

  @property
  def queued(self) -> int:
    """Requests waiting for the dispatcher (not those already running)."""
    return len(self._core.pending)

  def stats(self) -> ServeStats:
    """Counters: requests, batches and their sizes, traces, evictions."""
    return self._core.stats()

  def batch_function(self):
    """The ``jaxstreams.jit`` function one execution runs, for inspection:
    it takes up to ``groups`` requests, each an ``(args, kwargs)`` pair, and
    has ``.plan``, ``.trace`` and ``.lower`` (e.g.
    ``fn.trace(*reqs).lower(lowering_platforms=("cuda",)).as_text()`` shows
    one annotated call per request)."""
    return self._core.batch_function()

  def __enter__(self) -> "Server":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def __reduce__(self):
    raise TypeError(f"cannot pickle or copy {self!r}: a server holds its "
                    "threads and locks; make another with jaxstreams.serve")

  def __repr__(self) -> str:
    state = "closed" if self.closed else "open"
    return (f"<jaxstreams.serve {_name(self._core.fun)}: groups="
            f"{self._core.groups}, mode={self._core.mode}, {state}>")


class _GroupedServer(Server, functools.partial):
  __slots__ = ()


@functools.cache
def _direct_server_type(direct_call: type) -> type:
  return type("_DirectServer", (Server, direct_call),
              {"__module__": __name__, "__slots__": ()})


def _make_server(core: _Core) -> Server:
  """The server object. In direct mode it is the DirectCall itself (a
  request is one C call, see _direct.py); it and the core refer to each
  other, and with no thread to stop it needs no finalizer. A grouped
  server's finalizer closes its core, whose threads then end."""
  if core.direct:
    self = _direct_server_type(_direct_call_type())(
        core.jitted, _ARRAY_TYPE, jax.block_until_ready, core._admit_slowly,
        core._wake)
    self._admit_limit = core.limit
    core.direct_call = self
  else:
    self = _GroupedServer(_Core.call_grouped, core)
    weakref.finalize(self, core.close, False, None)
  self._core = core
  functools.update_wrapper(self, core.fun, updated=())
  return self


def _unwrap(fun: Callable) -> Callable:
  """A ``jaxstreams.jit`` function is served as its Python function: its
  stream blocks are flattened into the request's group like any others, and
  its annotated calls must not nest inside the request's region call."""
  spec = spec_of(fun)
  return fun if spec is None else spec.array_function("jaxstreams.serve")


def serve(fun: Callable | None = None, *, groups: int = 4,
          max_batch_wait_ms: float = 1.0, queue_size: int | None = 1024,
          block: bool | float = True, max_programs: int = 64,
          mode: str = "by_platform"):
  """Serve ``fun`` to many threads, running concurrent requests on streams.

  Usable as ``jaxstreams.serve(f, groups=4)`` or ``@jaxstreams.serve(...)``.

  Requests that arrive together (at most ``groups``) run in one execution
  in which request ``r`` of the batch runs on stream group ``r`` (compute
  stream ``r + 1`` of a ``jaxstreams.jit(streams=groups + 1)`` program; the
  main stream only passes results through). Each caller gets exactly what
  ``jax.jit(fun)(*args, **kwargs)`` gives (bitwise on CPU), or its own
  exception.

  Arguments:
    groups: stream groups, and so the most requests in one execution.
    max_batch_wait_ms: how long the dispatcher may wait for more requests
      while an execution is running. With nothing running it never waits:
      a lone request starts at once.
    queue_size: requests that may wait (``None``: unbounded).
    block: what ``submit`` / a call does on a full queue: ``True`` waits for
      room, ``False`` raises ``QueueFullError``, a number waits that many
      seconds and then raises it.
    max_programs: compiled batch programs kept (one per combination of
      request signatures, least recently used dropped first); up to
      ``max_programs * groups`` traced request signatures are kept too.
    mode: ``"by_platform"`` (the default) chooses from the platform and
      ``groups``, without measuring: it runs each request in its caller's
      thread as ``jax.jit(fun)`` where stream groups cannot pay: XLA:CPU,
      which runs one stream, ``groups=1``, and so far every GPU measured (an
      H100 with jax 0.11.2: grouped requests reached 0.36x-0.53x of the
      throughput of threads calling ``jax.jit``). ``"direct"`` and
      ``"grouped"`` force one way. In direct mode nothing queues:
      ``queue_size`` bounds the requests running at once, ``submit``
      dispatches in the caller's thread and returns a settled future, and
      ``close()`` waits for running requests. ``server.mode`` and
      ``stats().mode_reason`` say what was chosen and why.

  ``stream()`` blocks inside ``fun`` are flattened: a request runs whole on
  its group's stream, whatever ids ``fun`` names. A ``jaxstreams.jit``
  function is served as its Python function. Work with side effects
  (``jax.debug.print``, ordered callbacks) runs on the main stream, as in
  ``jaxstreams.jit``.

  Exceptions: a Python exception raised by ``fun`` while it is traced for a
  request's shapes goes to that caller only; if a batched execution fails,
  its requests are rerun one by one so each caller gets its own result or
  error. Worker threads start with the first request and end on ``close()``,
  on leaving a ``with`` block, or when the server is garbage-collected.
  """
  groups = _checks.integer(groups, name="groups", context="jaxstreams.serve",
                           minimum=1)
  max_programs = _checks.integer(max_programs, name="max_programs",
                                 context="jaxstreams.serve", minimum=1)
  queue_size = _checks.integer(queue_size, name="queue_size",
                               context="jaxstreams.serve", minimum=1,
                               none_ok=True)
  if isinstance(max_batch_wait_ms, bool) or not isinstance(
      max_batch_wait_ms, numbers.Real):
    raise TypeError(f"jaxstreams.serve: max_batch_wait_ms must be a number "
                    f">= 0, got {max_batch_wait_ms!r}")
  if not 0 <= max_batch_wait_ms < float("inf"):
    raise ValueError(f"jaxstreams.serve: max_batch_wait_ms must be a finite "
                     f"number >= 0, got {max_batch_wait_ms}")
  if not isinstance(block, bool):
    try:
      seconds = _checks.timeout(block, name="block",
                                context="jaxstreams.serve", zero_ok=True,
                                none_ok=False)
    except (TypeError, ValueError):   # worded for what block also takes
      raise TypeError(f"jaxstreams.serve: block must be True, False or a "
                      f"timeout in seconds >= 0, got {block!r}") from None
    block = True if seconds is None else seconds    # no bound: wait for room
  _checks.one_of(mode, MODES, name="mode", context="jaxstreams.serve")
  if fun is None:
    return lambda f: serve(f, groups=groups,
                           max_batch_wait_ms=max_batch_wait_ms,
                           queue_size=queue_size, block=block,
                           max_programs=max_programs, mode=mode)
  if not callable(fun):
    raise TypeError(f"jaxstreams.serve expects a callable, got {fun!r} of "
                    f"type {type(fun).__name__}")
  name = f"{THREAD_PREFIX}-{next(_server_ids)}"
  core = _Core(_unwrap(fun), groups, max_batch_wait_ms / 1000.0, queue_size,
               block, max_programs, name, mode)
  return _make_server(core)
