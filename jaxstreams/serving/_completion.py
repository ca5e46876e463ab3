"""Completion: each grouped request's own outcome, and room for the next batch.

A dispatched request waits for its own outputs, in its caller's thread (a
synchronous call) or in the *complete* helper thread (a submitted one, whose
future is then settled and whose admission token is given back). Whichever
waiter first sees a batch's outputs ready tells the batcher that its
execution ended: all outputs of one execution become ready together.

If the batch's execution failed (at dispatch, or while it ran), every
request in it is run again alone, in its own waiting thread, so each caller
gets its own result or its own error; a request that failed alone keeps its
error. A request whose model raised while traced never ran: it gets that
exception.
"""

from __future__ import annotations

import queue
import threading

from jaxstreams.serving import _batching


class Completion:

  def __init__(self, batcher, programs, wake):
    self.batcher = batcher
    self.programs = programs
    self.wake = wake                    # admission: a token came back
    self.queue: queue.SimpleQueue = queue.SimpleQueue()
    self.lock = threading.Lock()
    self.fallbacks = 0

  def finish(self, request: _batching.Request):
    """The outputs of a dispatched request (waited for), or its error."""
    if request.error is not None:
      raise request.error
    batch = request.batch
    failure = request.batch_error
    if failure is None:
      try:
        _batching.block(request.outputs)
      except Exception as e:  # noqa: BLE001 -- the execution failed
        failure = e
      finally:
        self.batcher.batch_ended(batch)
    else:
      self.batcher.batch_ended(batch)
    if failure is None:
      return request.outputs
    if batch.size == 1:
      raise failure
    with self.lock:
      if not batch.fell_back:
        batch.fell_back = True
        self.fallbacks += 1
    request.outputs = None
    (output,) = self.programs.run((request.key,), [request.payload])
    return _batching.block(output)

  # -- submitted requests: the complete helper thread ------------------------

  def complete_loop(self) -> None:
    while True:
      request = self.queue.get()
      if request is not None:
        self.settle(request)
        del request             # it holds its endpoint: let a server go
      elif self.batcher.done():           # closed, and nothing left to settle
        return

  def settle(self, request: _batching.Request) -> None:
    """Settle a submitted request's future and give back its token."""
    ok = False
    try:
      output = self.finish(request)
    except BaseException as e:  # noqa: BLE001 -- the caller's own error
      request.future.set_exception(e)
    else:
      request.future.set_result(output)
      ok = True
    finally:
      self._give_back(request, ok)

  def cancelled(self, request: _batching.Request) -> None:
    """A submitted request whose future was cancelled before it ran."""
    endpoint = request.endpoint
    endpoint._release()
    if endpoint._must_wake:
      self.wake()
    self.batcher.settled()

  def _give_back(self, request: _batching.Request, ok: bool) -> None:
    endpoint = request.endpoint
    endpoint._finish(ok)
    if endpoint._must_wake:
      self.wake()
    self.batcher.settled()
