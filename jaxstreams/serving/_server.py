"""``jaxstreams.serve``: many threads' requests for one model or several.

A request's path, one module each:

1. ``_admission``: may it enter (``queue_size``, ``block``, closing)?
2. ``_direct``: the request object a caller calls (C, or its Python twin);
   in *direct* mode it runs ``jax.jit(f)`` and that is the whole path.
3. ``_batching`` (grouped mode): callers form batches of up to ``groups``
   requests and dispatch them themselves.
4. ``_program``: a batch is one execution of a program in which each
   request is a region on a stream of its own: side by side on a GPU.
5. ``_completion``: each request waits for its own outputs, and is rerun
   alone where its batch failed.

``_choice`` decides between direct and grouped (``mode="by_platform"``);
``_stats`` holds the counters ``Server.stats()`` returns; this module puts
the parts together behind the public ``Server``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import numbers
import threading
import time
import weakref
from typing import Callable, Mapping

import jax
from jax import tree_util

from jaxstreams import _checks, _compat, _workers
from jaxstreams._jit import spec_of
from jaxstreams.runtime import _loader
from jaxstreams.serving import _choice, _direct
from jaxstreams.serving._admission import (Admission, QueueFullError,
                                           ServerClosedError)
from jaxstreams.serving._batching import Batcher
from jaxstreams.serving._completion import Completion
from jaxstreams.serving._program import Programs
from jaxstreams.serving._stats import ModelStats, ServeStats

__all__ = ["ModelStats", "QueueFullError", "ServeStats", "Server",
           "ServerClosedError", "serve"]

MODES = _choice.MODES
THREAD_PREFIX = "jaxstreams-serve"
_server_ids = itertools.count(1)
_ARRAY_TYPE = _compat.ARRAY_TYPE


@functools.cache
def _direct_call_type() -> type:
  """The C ``DirectCall`` where it was built with the native runtime, else
  the Python one (see _direct.py)."""
  return _direct.native(_loader.search_dirs()) or _direct.PyDirectCall


# ---------------------------------------------------------------------------
# The parts put together.

class _Core:
  """Everything a server's requests share. Its helper threads hold the
  batcher and completion, never this core nor a server, so dropping the last
  server reference lets it be collected; its finalizer closes this core."""

  def __init__(self, models: list[tuple[str, Callable]], groups: int,
               wait_s: float, queue_size: int | None, block: bool | float,
               max_programs: int, name: str, mode: str):
    self.models = models
    self.names = [model_name for model_name, _ in models]
    self.jitted = [jax.jit(fun) for _, fun in models]
    self.groups = groups
    self.name = name
    limit = _direct.MAX_SSIZE if queue_size is None else queue_size
    self.admission = Admission(name, queue_size, block, limit)
    self.workers = _workers.Workers(name)
    self.programs = Programs(models, groups, max_programs)
    self.batcher = Batcher(self.programs, self.jitted, groups, wait_s,
                           self.workers)
    self.completion = Completion(self.batcher, self.programs,
                                 self.admission.wake)
    self.batcher.completion = self.completion
    start = _choice.start(mode, groups)
    self.mode, self.mode_reason = start.mode, start.reason
    self.deciding = start.measure       # a trial is due (by_platform, GPU)
    self.decide_lock = threading.Lock()
    self.warmed: list[tuple[int, tuple]] = []   # (model, payload) examples
    self.admission.grouped = self.mode == "grouped"

  @property
  def block(self):
    return self.admission.block

  @property
  def closing(self) -> bool:
    return self.admission.closing

  def add_endpoint(self, model: int, cls: type):
    target, wait = self._target(model)
    admit = _AdmitSlowly(self.admission)
    endpoint = cls(target, _ARRAY_TYPE, jax.block_until_ready, admit,
                   self.admission.wake)
    endpoint._wait = wait
    admit.endpoint = weakref.proxy(endpoint)
    endpoint._admit_limit = self.admission.limit
    endpoint._core = self
    endpoint._model = model
    self.admission.add(endpoint)
    return endpoint

  def _target(self, model: int) -> tuple[Callable, bool]:
    """What an endpoint calls in the current mode, and whether it waits."""
    if self.deciding:
      return functools.partial(self.deciding_call, model), False
    if self.mode == "grouped":
      return functools.partial(self.batcher.call, model), False
    return self.jitted[model], True

  def _retarget(self) -> None:
    self.admission.grouped = self.mode == "grouped"
    for endpoint in self.admission.live():
      # A request that starts during the switch may pair the old target
      # with the new flag: results are right either way (a direct result
      # is then returned before it is computed, as jax.jit returns it).
      target, wait = self._target(endpoint._model)
      endpoint._target = target
      endpoint._wait = wait

  # -- the by-platform choice ------------------------------------------------

  def deciding_call(self, model: int, *args, **kwargs):
    """A request while the by-platform choice is due: it runs direct. The
    first to get its result makes the choice on its signature before it
    returns (as ``jaxstreams.jit``'s first call times its ways); the others
    go on direct meanwhile."""
    output = jax.block_until_ready(self.jitted[model](*args, **kwargs))
    if self.decide_lock.acquire(blocking=False):
      try:
        if self.deciding:
          self._decide([(model, (args, kwargs))])
      finally:
        self.decide_lock.release()
    return output

  def _decide(self, examples) -> None:
    """Holding ``decide_lock``: measure, then switch the endpoints."""
    try:
      with self.batcher.uncounted():
        decision = _choice.decide(self.programs, self.jitted,
                                  self.batcher.call, examples, self.groups)
    except Exception as e:  # noqa: BLE001 -- the requests go on, direct
      self.mode = "direct"
      self.mode_reason = (f"kept 'direct': measuring grouped failed "
                          f"({type(e).__name__}: {e})")
    else:
      self.mode = decision.way
      self.mode_reason = _choice.describe(decision, self.groups)
    self.deciding = False
    self._retarget()

  def warmup(self, examples: list[tuple[int, tuple]]) -> int:
    """Compile what ``examples`` (``(model, (args, kwargs))``) need and,
    where the choice is due, make it now. Returns the batch programs
    compiled."""
    examples = [(model, _materialize(payload)) for model, payload in examples]
    for model, (args, kwargs) in examples:
      jax.block_until_ready(self.jitted[model](*args, **kwargs))
    with self.decide_lock:
      before = self.programs.stats()["programs_traced"]
      self.warmed.extend(examples)
      if self.deciding:
        self._decide(examples)
      if self.mode == "grouped":
        self.programs.warm([self.programs.key(model, payload)
                            for model, payload in self.warmed])
      return self.programs.stats()["programs_traced"] - before

  # -- submit ----------------------------------------------------------------

  def submit(self, endpoint, model: int, args: tuple,
             kwargs: dict) -> concurrent.futures.Future:
    if not endpoint._take(endpoint._admit_limit):
      self.admission.admit_slowly(endpoint)
    future: concurrent.futures.Future = concurrent.futures.Future()
    if self.mode == "grouped" and not self.deciding:
      try:
        self.batcher.submit(model, (args, kwargs), future, endpoint)
      except BaseException:
        endpoint._release()
        raise
      return future
    # Direct: dispatched in the caller's thread as jax.jit would be; the
    # future is settled on return and holds jax.jit's (asynchronously
    # computed) result or the caller's own error.
    ok = False
    try:
      future.set_result(self.jitted[model](*args, **kwargs))
      ok = True
    except Exception as e:  # noqa: BLE001 -- this caller's own error
      future.set_exception(e)
    finally:
      endpoint._finish(ok)
      if endpoint._must_wake:
        self.admission.wake()
    return future

  # -- closing and stats -----------------------------------------------------

  def close(self, join: bool, timeout: float | None) -> bool:
    """Refuse new requests and let partial batches go at once; with
    ``join``, wait up to ``timeout`` seconds for the admitted requests and
    the helper threads to end."""
    deadline = None if timeout is None else _now() + timeout
    self.admission.close()
    self.batcher.close()
    if not join:
      return True
    left = lambda: None if deadline is None else max(0.0, deadline - _now())
    return self.admission.drain(left()) and self.workers.join(left())

  def stats(self) -> ServeStats:
    batching = self.batcher.stats()
    programs = self.programs.stats()
    per_model = {}
    for endpoint in self.admission.live():
      finished, failed, running = (endpoint._finished, endpoint._failed,
                                   endpoint._running)
      cancelled = batching["cancelled"].get(endpoint._model, 0)
      per_model[self.names[endpoint._model]] = ModelStats(
          requests=finished + running + cancelled,
          completed=finished - failed, failed=failed, cancelled=cancelled)
    total = lambda field: sum(getattr(s, field) for s in per_model.values())
    return ServeStats(
        requests=total("requests"), completed=total("completed"),
        failed=total("failed"), batches=batching["batches"],
        batch_sizes=batching["batch_sizes"],
        signatures_traced=programs["signatures_traced"],
        programs_traced=programs["programs_traced"],
        programs_cached=programs["programs_cached"],
        program_evictions=programs["program_evictions"],
        fallbacks=self.completion.fallbacks, mode=self.mode,
        mode_reason=self.mode_reason,
        direct=total("requests") - batching["requests"],
        cancelled=total("cancelled"), models=per_model)


class _AdmitSlowly:
  """An endpoint's way into the admission's locked path. The endpoint is
  passed as a weak proxy: admission is reachable from helper threads, which
  must not keep a server alive."""

  __slots__ = ("admission", "endpoint")

  def __init__(self, admission: Admission):
    self.admission = admission
    self.endpoint = None

  def __call__(self) -> None:
    self.admission.admit_slowly(self.endpoint)


def _now() -> float:
  return time.monotonic()


def _materialize(payload: tuple) -> tuple:
  """An ``(args, kwargs)`` request with each ``jax.ShapeDtypeStruct`` leaf
  replaced by zeros of its shape, dtype and sharding."""
  def leaf(x):
    if not isinstance(x, jax.ShapeDtypeStruct):
      return x
    zeros = jax.numpy.zeros(x.shape, x.dtype)
    sharding = getattr(x, "sharding", None)
    return zeros if sharding is None else jax.device_put(zeros, sharding)
  return tree_util.tree_map(leaf, payload)


# ---------------------------------------------------------------------------
# The public objects.

class _Endpoint:
  """One model of a server, as callers call it: ``endpoint(*args,
  **kwargs)`` returns the model's result, ``submit`` a future. Every
  instance is also a ``DirectCall`` (_direct.py), whose call is the request:
  no Python frame between a caller and ``jax.jit`` in direct mode."""

  def submit(self, *args, **kwargs) -> concurrent.futures.Future:
    """Queue a request; the future holds its result or its own error.

    Raises ``ServerClosedError`` once the server is closing, and
    ``QueueFullError`` when the model has ``queue_size`` requests in the
    server and the server does not block.
    """
    return self._core.submit(self, self._model, args, kwargs)

  def warmup(self, *args, **kwargs) -> int:
    """Compile ahead what requests of this signature run: ``jax.jit`` of
    the model and, in grouped mode, every batch program of up to ``groups``
    requests of the signatures warmed so far (all models). Arguments may be
    arrays or ``jax.ShapeDtypeStruct`` (run on zeros: each program runs
    once). With ``mode="by_platform"`` on a GPU, the first warmup makes the
    choice between direct and grouped. Returns the batch programs compiled;
    ``ValueError`` where they would not fit in ``max_programs``."""
    return self._core.warmup([(self._model, (args, kwargs))])

  @property
  def model_name(self) -> str:
    return self._core.names[self._model]


class Server:
  """A thread-safe server made by ``jaxstreams.serve``.

  Serving one function, the server is callable: ``server(*args, **kwargs)``
  waits for and returns ``f(*args, **kwargs)``, and ``server.submit(...)``
  returns a ``concurrent.futures.Future``. Serving a dict of functions,
  ``server[name]`` is that model's endpoint, with the same call and
  ``submit``. Use it as a context manager, or call ``close()``: admitted
  requests are finished, new ones raise ``ServerClosedError``, and the
  helper threads end. They also end when the server is garbage-collected.
  """

  def close(self, timeout: float | None = None) -> bool:
    """Refuse new requests, finish the admitted ones, and stop the threads.

    Waits up to ``timeout`` seconds (``None``: until done) and returns
    whether everything has ended. Calling it again is harmless.
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
  def models(self) -> tuple[str, ...]:
    """The names of the models served."""
    return tuple(self._core.names)

  @property
  def queued(self) -> int:
    """Grouped requests waiting for a batch (not those already running)."""
    return len(self._core.batcher.pending)

  def stats(self) -> ServeStats:
    """Counters: requests (in all and per model), batches and their sizes,
    traces, evictions, the mode and why."""
    return self._core.stats()

  def batch_function(self, models=None):
    """The ``jaxstreams.jit`` function one grouped execution runs, for
    inspection: it takes up to ``groups`` requests, each an ``(args,
    kwargs)`` pair, request ``r`` for model ``models[r]`` (a sequence of
    model names; None: the first model for every request), and has
    ``.plan``, ``.trace`` and ``.lower`` (``fn.trace(*reqs).lower(
    lowering_platforms=("cuda",))`` given to ``jaxstreams.xla_graphs`` shows
    the requests as parallel branches of the GPU's graph)."""
    if models is None:
      return self._core.programs.batch_function()
    names = self._core.names
    if isinstance(models, str) or not all(m in names for m in models):
      raise ValueError(f"batch_function: models must be a sequence of model "
                       f"names from {tuple(names)}, got {models!r}")
    return self._core.programs.batch_function(
        tuple(names.index(m) for m in models))

  def __enter__(self) -> "Server":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def __reduce__(self):
    raise TypeError(f"cannot pickle or copy {self!r}: a server holds its "
                    "threads and locks; make another with jaxstreams.serve")

  def __repr__(self) -> str:
    core = self._core
    state = "closed" if self.closed else "open"
    reason = core.mode_reason
    return (f"<jaxstreams.serve {', '.join(core.names)}: groups="
            f"{core.groups}, mode={core.mode} ({reason}), {state}>")


class _MultiServer(Server):
  """A server of several models: ``server[name]`` is one model's endpoint."""

  def __getitem__(self, name: str):
    endpoints = self._endpoints
    if name not in endpoints:
      raise KeyError(f"{self._core.name} serves the models "
                     f"{tuple(endpoints)}, not {name!r}")
    return endpoints[name]

  def __call__(self, *args, **kwargs):
    raise TypeError(f"a server of several models ({', '.join(self.models)}) "
                    "is not called itself: call one model's endpoint, "
                    f"server[{self.models[0]!r}](...)")

  def submit(self, *args, **kwargs):
    raise TypeError(f"a server of several models ({', '.join(self.models)}) "
                    "takes requests at each model's endpoint: "
                    f"server[{self.models[0]!r}].submit(...)")

  def warmup(self, examples: Mapping[str, tuple]) -> int:
    """``warmup`` for several models at once: ``examples`` maps model names
    to a tuple of positional arguments each (``server[name].warmup`` takes
    keywords too). With ``mode="by_platform"`` on a GPU the choice is made
    on all of them together. Returns the batch programs compiled."""
    if not isinstance(examples, Mapping) or not all(
        name in self._endpoints and isinstance(args, tuple)
        for name, args in examples.items()):
      raise TypeError(f"warmup takes a dict of model name -> tuple of "
                      f"arguments, names from {self.models}; got {examples!r}")
    names = self._core.names
    return self._core.warmup([(names.index(name), (args, {}))
                              for name, args in examples.items()])


@functools.cache
def _endpoint_type(direct_call: type, server: bool) -> type:
  bases = ((Server, _Endpoint, direct_call) if server
           else (_Endpoint, direct_call))
  return type("_Server" if server else "_ModelEndpoint", bases,
              {"__module__": __name__})


def _unwrap(fun: Callable) -> Callable:
  """A ``jaxstreams.jit`` function is served as its Python function: its
  stream blocks are flattened into the request's region like any others,
  and its annotated calls must not nest inside the request's region."""
  spec = spec_of(fun)
  return fun if spec is None else spec.array_function("jaxstreams.serve")


def _models_of(fun) -> list[tuple[str, Callable]]:
  if isinstance(fun, Mapping):
    if not fun:
      raise ValueError("jaxstreams.serve: the dict of models is empty; give "
                       "it name -> function pairs")
    models = []
    for name, model in fun.items():
      if not isinstance(name, str):
        raise TypeError(f"jaxstreams.serve: model names must be strings, got "
                        f"{name!r} of type {type(name).__name__}")
      if not callable(model):
        raise TypeError(f"jaxstreams.serve: model {name!r} must be a "
                        f"callable, got {model!r} of type "
                        f"{type(model).__name__}")
      models.append((name, _unwrap(model)))
    return models
  if not callable(fun):
    raise TypeError(f"jaxstreams.serve expects a callable or a dict of name "
                    f"-> callable, got {fun!r} of type {type(fun).__name__}")
  return [(_name(fun), _unwrap(fun))]


def _name(fun) -> str:
  return getattr(fun, "__name__", None) or type(fun).__name__


def serve(fun: Callable | Mapping[str, Callable] | None = None, *,
          groups: int = 4, max_batch_wait_ms: float = 1.0,
          queue_size: int | None = 1024, block: bool | float = True,
          max_programs: int = 64, mode: str = "by_platform"):
  """Serve ``fun`` (or a dict of name -> function) to many threads.

  Usable as ``jaxstreams.serve(f)``, ``jaxstreams.serve({"a": f, "b": g})``
  or ``@jaxstreams.serve(...)``. Each caller gets exactly what
  ``jax.jit(f)(*args, **kwargs)`` gives (bitwise on CPU), or its own
  exception. Requests run one of two ways (``server.mode``):

  * ``"direct"``: each request is ``jax.jit(f)`` in its caller's thread,
    as a plain thread would run it. Nothing queues: ``queue_size`` bounds
    the requests running at once, and ``submit`` runs the request in the
    caller's thread and returns a settled future.
  * ``"grouped"``: requests that arrive together (at most ``groups``, of
    any models and shapes) run as one execution in which each request is a
    region on a stream of its own: on a GPU, parallel branches of the
    program's CUDA graph. One program is compiled per combination of
    request signatures (models, shapes, dtypes), at most ``max_programs``
    kept; ``warmup`` compiles them ahead.

  Arguments:
    groups: the most requests in one grouped execution.
    max_batch_wait_ms: how long a grouped batch may wait for more requests
      while an execution is running. With nothing running it never waits.
    queue_size: requests of one model that may be in the server at once
      (``None``: unbounded).
    block: what a call or ``submit`` does when ``queue_size`` is reached:
      ``True`` waits for room, ``False`` raises ``QueueFullError``, a number
      waits that many seconds and then raises it.
    max_programs: grouped batch programs kept (least recently used dropped
      first); up to ``max_programs * groups`` traced request signatures too.
    mode: ``"by_platform"`` (the default) runs direct on XLA:CPU and every
      platform without several streams, and with ``groups=1``; on a GPU it
      measures both ways at the first request (or ``warmup``) and keeps
      grouped only where it measured faster (``jaxstreams.serving._choice``).
      ``"direct"`` and ``"grouped"`` force one way. ``stats().mode_reason``
      and the repr say what was chosen and why.

  ``stream()`` blocks inside a model are flattened: a request runs whole on
  its region's stream. A ``jaxstreams.jit`` function is served as its Python
  function. Exceptions: a Python exception raised by a model while traced
  for a request goes to that caller only; a batch whose execution fails is
  rerun request by request, so each caller gets its own result or error.
  Helper threads (grouped ``submit`` only) start with the first ``submit``
  and end on ``close()``, on leaving a ``with`` block, or when the server is
  garbage-collected.
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
  models = _models_of(fun)
  name = f"{THREAD_PREFIX}-{next(_server_ids)}"
  core = _Core(models, groups, max_batch_wait_ms / 1000.0, queue_size, block,
               max_programs, name, mode)
  if isinstance(fun, Mapping):
    server = _MultiServer()
    server._core = core
    kind = _endpoint_type(_direct_call_type(), False)
    server._endpoints = {}
    for model, (model_name, _) in enumerate(models):
      endpoint = core.add_endpoint(model, kind)
      endpoint._server = server          # an endpoint keeps its server alive
      server._endpoints[model_name] = endpoint
  else:
    server = core.add_endpoint(0, _endpoint_type(_direct_call_type(), True))
    functools.update_wrapper(server, fun, updated=())
  weakref.finalize(server, core.close, False, None)
  return server
