"""Batching: how a grouped request joins the execution it runs in.

The callers form the batches themselves. A synchronous request is queued;
if no thread holds the *dispatcher role*, its caller takes it, takes up to
``groups`` queued requests (its own among them), dispatches them as one
execution (``_program``) and hands each request its outputs; the others'
callers, waiting on a lock of their own, wake with outputs to wait for.
So a batch costs one wake per request that another thread dispatched, and
none for a request whose caller dispatched it; there is no dispatcher thread
between a caller and the device, and each caller waits for its own results
(``_completion``) while the device runs. A request that finds the server
idle (nothing queued or running, nobody dispatching) is a batch of one and
runs as ``jax.jit`` of its model, with none of a batch's bookkeeping.

Once the role holder has taken the batch that holds its own request, it
passes the role to the oldest caller still waiting in the queue (or to
nobody, with the queue empty) and then launches the batch, so the next
batch forms while this one is launched. At most ``MAX_IN_FLIGHT``
executions are dispatched and unfinished; the role holder waits while that
many run, which is what makes requests arrive together: on a GPU the device
runs one execution while the next waits, and the queue fills meanwhile. A
role holder with room but only part of a batch waits up to
``max_batch_wait_ms`` for more while an execution runs, never while the
device is idle nor once the server is closing.

``submit`` (a ``Future``) does no work in the caller's thread: its request
is queued, and where no caller holds the role a *dispatch* helper thread
takes it; a *complete* helper thread waits for each submitted request's
outputs. Both start with the first ``submit``.

Failures stay with their request: a Python exception raised while tracing a
request's model leaves that request out of the batch before it is built; a
batch whose execution fails is rerun request by request (``_completion``); a
future cancelled before its batch is built leaves it; a caller interrupted
while it waits leaves the queue (or, once dispatched, its batch), and the
others in the batch are untouched.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import concurrent.futures
import threading
import time
from typing import Any

import jax

from jaxstreams import _compat

_ARRAY_TYPE = _compat.ARRAY_TYPE

MAX_IN_FLIGHT = 2       # executions dispatched and not yet finished

QUEUED, LEAD, DISPATCHED, CANCELLED = ("queued", "lead", "dispatched",
                                       "cancelled")
HELPER = "dispatch helper"      # the role's holder when it is the helper thread


class Request:
  """One grouped request on its way. ``waiter`` is a lock its caller waits
  on (None for a submitted request, which has a ``future`` instead)."""

  __slots__ = ("model", "payload", "waiter", "future", "endpoint", "state",
               "key", "order", "outputs", "error", "batch_error", "batch")

  def __init__(self, model: int, payload: tuple, waiter=None, future=None,
               endpoint=None):
    self.model = model
    self.payload = payload
    self.waiter = waiter
    self.future = future
    self.endpoint = endpoint
    self.state = QUEUED
    self.key = self.order = self.outputs = None
    self.error = None          # this request's own (a trace error)
    self.batch_error = None    # its batch's execution failed at dispatch
    self.batch = None


class Batch:
  """One execution: its size, and whether it has been seen to end."""

  __slots__ = ("size", "ended", "fell_back")

  def __init__(self, size: int):
    self.size = size
    self.ended = size == 0       # nothing ran
    self.fell_back = False


class Batcher:

  def __init__(self, programs, jitted, groups: int, wait_s: float, workers):
    self.programs = programs
    self.jitted = jitted                 # jax.jit of each model
    self.groups = groups
    self.wait_s = wait_s
    self.workers = workers
    self.completion = None               # set by the server (_completion)
    self.lock = threading.Lock()
    self.work = threading.Condition(self.lock)     # the role holder waits
    self.helper = threading.Condition(self.lock)   # the dispatch helper waits
    self.pending: collections.deque[Request] = collections.deque()
    self.in_flight = 0
    self.leader: Any = None              # a Request, HELPER or None
    self.closing = False
    self.submitted = 0                   # submitted and not yet settled
    self.batches = 0
    self.batch_sizes: collections.Counter[int] = collections.Counter()
    self.cancelled: collections.Counter[int] = collections.Counter()
    self.requests = 0                    # taken in, synchronous or submitted

  # -- synchronous requests --------------------------------------------------

  def call(self, model: int, /, *args, **kwargs):
    """Run one request of model ``model`` and return its outputs (ready)."""
    with self.lock:
      alone = self.leader is None and not self.in_flight and not self.pending
      if alone:                          # an idle server: a batch of one
        self.in_flight += 1
        self.requests += 1
    if alone:
      return self._run_alone(model, args, kwargs)
    waiter = _thread.allocate_lock()
    waiter.acquire()
    request = Request(model, (args, kwargs), waiter=waiter)
    with self.lock:
      self.requests += 1
      self.pending.append(request)
      if self.leader is None:
        self.leader = request
      elif len(self.pending) >= self.groups:
        self.work.notify()
    try:
      if self.leader is not request:
        waiter.acquire()                # dispatched, or handed the role
      if request.state is not DISPATCHED:
        self._lead(request, request)
    except BaseException:
      self._abandon(request)
      raise
    return self.completion.finish(request)

  def _run_alone(self, model: int, args: tuple, kwargs: dict):
    """A request that found nothing queued or running: ``jax.jit`` of its
    model in its caller's thread, which is what a batch of one would run,
    with none of a batch's bookkeeping. Its trace is kept as any request's
    (a model's error while traced is raised here, as in a batch)."""
    ran = False
    try:
      self.programs.traced_for(self.programs.key(model, (args, kwargs)))
      ran = True
      output = self.jitted[model](*args, **kwargs)
      return block(output)
    finally:
      with self.lock:
        self.in_flight -= 1
        if ran:
          self.batches += 1
          self.batch_sizes[1] += 1
        self.work.notify()

  def _abandon(self, request: Request) -> None:
    """A caller leaves before its request finished (KeyboardInterrupt): out
    of the queue, or out of its batch, and the role passed on."""
    with self.lock:
      undone = request.state is not DISPATCHED
      if undone:
        self._withdraw_locked(request)
      if self.leader is request:
        self.leader = None
        self._assign_leader_locked()
    if not undone and request.batch is not None:
      self.batch_ended(request.batch)

  def _withdraw_locked(self, request: Request) -> None:
    try:
      self.pending.remove(request)
    except ValueError:
      pass
    request.state = CANCELLED

  # -- submitted requests ----------------------------------------------------

  def submit(self, model: int, payload: tuple,
             future: concurrent.futures.Future, endpoint) -> None:
    """Queue one request whose outputs go to ``future``; ``endpoint`` holds
    its admission token until it is settled."""
    request = Request(model, payload, future=future, endpoint=endpoint)
    with self.lock:
      if not self.workers.threads:
        self.workers.start("dispatch", self._helper_loop)
        self.workers.start("complete", self.completion.complete_loop)
      self.submitted += 1
      self.requests += 1
      self.pending.append(request)
      if self.leader is None:
        self._assign_leader_locked()
      elif len(self.pending) >= self.groups:
        self.work.notify()

  def settled(self) -> None:
    """A submitted request was settled (its future holds its outcome)."""
    with self.lock:
      self.submitted -= 1
      self._stop_helpers_if_done_locked()

  def done(self) -> bool:
    """Closed, with every submitted request settled: the helpers end."""
    with self.lock:
      return self.closing and not self.submitted

  def _stop_helpers_if_done_locked(self) -> None:
    if self.closing and not self.submitted:
      self.helper.notify_all()
      self.completion.queue.put(None)

  def _helper_loop(self) -> None:
    while True:
      with self.lock:
        while self.leader is not HELPER:
          if self.closing and not self.submitted:
            return
          self.helper.wait()
      self._lead(HELPER, None)

  # -- the dispatcher role ---------------------------------------------------

  def _assign_leader_locked(self) -> None:
    """With the role free and requests queued, hand it to the oldest caller
    waiting in its own thread, else to the dispatch helper."""
    if self.leader is not None or not self.pending:
      return
    for request in self.pending:
      if request.waiter is not None:
        self.leader = request
        request.state = LEAD
        request.waiter.release()
        return
    self.leader = HELPER
    self.helper.notify()

  def _lead(self, holder, mine: Request | None) -> None:
    """Holding the role: take batches until one holds ``mine`` (the helper,
    with no request of its own: one batch), pass the role on, and dispatch
    that batch. The role goes before the dispatch, so that the next batch
    can form while this one is traced and launched (on XLA:CPU a launch
    may run the whole program)."""
    passed = False
    try:
      while True:
        batch = self._take()
        last = not batch or mine is None or any(r is mine for r in batch)
        if last:
          self._pass_role(holder)
          passed = True
        if batch:
          self._dispatch(batch)
        if last:
          return
    finally:
      if not passed:                     # leaving on an exception
        with self.lock:
          if mine is not None and mine.state is not DISPATCHED:
            self._withdraw_locked(mine)
        self._pass_role(holder)

  def _pass_role(self, holder) -> None:
    with self.lock:
      if self.leader is holder:
        self.leader = None
        self._assign_leader_locked()

  def _take(self) -> list[Request]:
    """The next batch, once the policy (module docstring) lets it go."""
    with self.lock:
      deadline = None
      while self.pending:
        if self.in_flight < MAX_IN_FLIGHT:
          if (len(self.pending) >= self.groups or not self.in_flight
              or self.closing):
            break
          now = time.monotonic()
          if deadline is None:
            deadline = now + self.wait_s
          if now >= deadline:
            break
          self.work.wait(deadline - now)
        else:
          self.work.wait()
      else:
        return []
      batch = [self.pending.popleft()
               for _ in range(min(self.groups, len(self.pending)))]
      self.in_flight += 1
      return batch

  def _dispatch(self, batch: list[Request]) -> None:
    """Trace what is new, start one execution for the batch, and hand each
    request its outputs (or its error)."""
    runnable = []
    try:
      for request in batch:
        if (request.future is not None
            and not request.future.set_running_or_notify_cancel()):
          request.state = CANCELLED
          continue
        try:
          request.key = self.programs.key(request.model, request.payload)
          request.order = self.programs.traced_for(request.key).order
        except BaseException as e:  # noqa: BLE001 -- this request's own, even
          request.error = e         # a KeyboardInterrupt its model raised
          continue
        runnable.append(request)
      if runnable:
        runnable.sort(key=_order)
        try:
          outputs = self.programs.run(tuple(r.key for r in runnable),
                                      [r.payload for r in runnable])
        except Exception as e:  # noqa: BLE001 -- each request is rerun alone
          for request in runnable:
            request.batch_error = e
        else:
          for request, output in zip(runnable, outputs):
            request.outputs = output
    except BaseException as e:      # interrupted in the dispatching thread
      for request in runnable:
        if request.outputs is None:
          request.batch_error = e
      raise
    finally:
      self._hand_out(batch, Batch(len(runnable)))

  def _hand_out(self, batch: list[Request], record: Batch) -> None:
    with self.lock:
      if record.size:
        self.batches += 1
        self.batch_sizes[record.size] += 1
      else:
        self.in_flight -= 1
    for request in batch:
      request.batch = record
      if request.state is CANCELLED:
        with self.lock:
          self.cancelled[request.model] += 1
        self.completion.cancelled(request)
        continue
      request.state = DISPATCHED
      if request.future is not None:
        self.completion.queue.put(request)
      elif request.waiter.locked():
        request.waiter.release()

  def batch_ended(self, batch: Batch) -> None:
    """An execution was seen to end (or every caller left it): room for the
    next one."""
    with self.lock:
      if batch.ended:
        return
      batch.ended = True
      self.in_flight -= 1
      self.work.notify()

  # -- closing ---------------------------------------------------------------

  def close(self) -> None:
    """No new requests come (admission refuses them); the helpers end once
    every submitted request is settled."""
    with self.lock:
      self.closing = True
      self.work.notify_all()
      self._stop_helpers_if_done_locked()

  @contextlib.contextmanager
  def uncounted(self):
    """Requests and batches inside are left out of the counts (the
    by-platform trial's, which run while no request of the server is
    grouped)."""
    with self.lock:
      saved = (self.requests, self.batches, self.batch_sizes.copy())
    try:
      yield
    finally:
      with self.lock:
        self.requests, self.batches, self.batch_sizes = saved

  def stats(self) -> dict:
    with self.lock:
      return {"batches": self.batches,
              "batch_sizes": dict(sorted(self.batch_sizes.items())),
              "cancelled": dict(self.cancelled), "queued": len(self.pending),
              "requests": self.requests}


def _order(request: Request) -> int:
  return request.order


def block(output):
  """``output`` once computed (one array: its own method, the cheapest)."""
  if type(output) is _ARRAY_TYPE:
    return output.block_until_ready()
  return jax.block_until_ready(output)
