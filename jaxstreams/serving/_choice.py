"""The by-platform choice: whether a server's requests run direct or grouped.

*Direct*: each request is ``jax.jit(f)`` in its caller's thread, exactly
what a plain thread does. *Grouped*: requests that arrive together run as
one execution, side by side (``_batching``, ``_program``). Grouping can only
pay where one execution runs several requests at once and threads calling
``jax.jit`` do not: as read in XLA's sources, JAX's GPU clients launch
every execution of a device on its one compute stream, so programs from
several threads run one after another (``benchmarks/serve.py --trace``
checks that on a GPU), while a batch's requests are parallel branches of
one program's CUDA graph. It costs the hand-offs between callers and a batch
program per combination of requests.

``mode="by_platform"`` (the default) decides so:

* XLA:CPU runs one stream, and so does every platform but a GPU: direct,
  without measuring (a batch there runs its requests one after another,
  after hand-offs they did not need).
* ``groups=1``: direct (no two requests can run side by side).
* A GPU: direct until the first request (or ``warmup``), which measures
  both on the server's own models, as ``jaxstreams.jit``'s first call times
  its ways: every batch program of the request's signature is compiled,
  then ``groups`` client threads send copies of the request through each
  way in interleaved rounds (``jaxstreams.choose.timing.time_interleaved``), and
  grouped is kept only where it beats direct by that function's margin in
  the median and in most rounds. Direct is the baseline: a server is never
  made slower by a choice it could not confirm. The decision is cached on
  disk (the ``jaxstreams_autotune_cache`` option), keyed by the request's
  program, ``groups``, the device kind and the jax and jaxlib versions; with
  ``jaxstreams_autotune`` off nothing is measured and requests run direct.

``time_way`` is the one clock of the trial; tests replace it (a fake clock),
and ``platform`` (a fake platform).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Callable, Sequence

import jax

from jaxstreams import config
from jaxstreams.choose import timing

MODES = ("by_platform", "direct", "grouped")
WAYS = ("direct", "grouped")
REQUESTS_PER_CLIENT = 4     # each client's requests in one timed run


def platform() -> str:
  """The platform requests run on (a function, so tests can pretend)."""
  return jax.default_backend()


def time_way(way: str, run: Callable[[], object]) -> float:
  """Seconds of one timed run of ``way``: the trial's one clock."""
  return timing.time_call(way, run)


@dataclasses.dataclass(frozen=True)
class Start:
  """How a server starts: its mode, why, and whether a trial is due."""
  mode: str
  reason: str
  measure: bool = False


def start(mode: str, groups: int) -> Start:
  if mode != "by_platform":
    return Start(mode, f"mode={mode!r} was asked for")
  where = platform()
  if where == "cpu":
    return Start("direct", "XLA:CPU runs one stream: grouped requests would "
                 "run one after another anyway, after hand-offs between "
                 "threads")
  if where != "gpu":
    return Start("direct", f"{where} runs each program on one stream: "
                 "nothing for grouped requests to gain")
  if groups == 1:
    return Start("direct", "groups=1: no two requests can run side by side")
  if not config.read("jaxstreams_autotune"):
    return Start("direct", "jaxstreams_autotune is off: grouped requests are "
                 "kept only where measured faster, and nothing is measured; "
                 "mode='grouped' runs them grouped")
  return Start("direct", "deciding: the first request (or warmup) measures "
               "grouped against direct", measure=True)


def decide(programs, jitted: Sequence[Callable], call_grouped: Callable,
           examples: Sequence[tuple[int, tuple]], groups: int
           ) -> timing.Decision:
  """Measure direct against grouped on ``examples`` (``(model, (args,
  kwargs))`` pairs, which have run once already) and return the decision,
  from the cache where it was made before."""
  key = _cache_key(jitted, examples, groups)
  cached = timing.load(key)
  if cached is not None and cached.way in WAYS:
    return cached
  programs.warm([programs.key(model, payload) for model, payload in examples])

  def direct(model, /, *args, **kwargs):
    return jax.block_until_ready(jitted[model](*args, **kwargs))

  with concurrent.futures.ThreadPoolExecutor(
      groups, thread_name_prefix="jaxstreams-serve-trial") as pool:

    def clients(call):
      def client(first):
        for i in range(first, first + REQUESTS_PER_CLIENT):
          model, (args, kwargs) = examples[i % len(examples)]
          call(model, *args, **kwargs)

      def run():
        for future in [pool.submit(client, c) for c in range(groups)]:
          future.result()
      return run

    decision = timing.time_interleaved(
        {"direct": clients(direct), "grouped": clients(call_grouped)},
        baseline="direct", timer=time_way)
  timing.store(key, decision)
  return decision


def _cache_key(jitted, examples, groups: int) -> str:
  texts = []
  for model, (args, kwargs) in examples:
    texts.append(jitted[model].lower(*args, **kwargs).as_text())
  device = jax.devices()[0].device_kind
  return timing.cache_key("serve\n" + "\n".join(texts), device, groups,
                            ("serve",) + WAYS)


def describe(decision: timing.Decision, groups: int) -> str:
  """The reason a server gives for its mode after a trial."""
  run = (f"{groups} client threads x {REQUESTS_PER_CLIENT} requests per "
         "timed run")
  return f"measured ({run}): {decision.describe()}"
