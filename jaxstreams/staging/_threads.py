"""``staged(mode="threads")``: each producer stage in a worker thread.

Each producer stage is a jitted function of the values it needs, run by a
``Prefetcher`` (one worker thread, ``capacity`` items ahead) over the
previous stage's; stage 0's worker also does the host-to-device copy of the
batch, and a reader thread before it pulls the batches, so reading (I/O
waits, Python parsing) overlaps with stage 0's computation too. Workers wait
until their results are ready, so an item handed on is complete and memory
is bounded by ``capacity`` items per stage. The consumer runs in the
caller's thread, on values that are already there. On CPU this runs
producer computation on other cores (each program runs on its caller's
thread); on a GPU it hides host work and copies only. Nothing is donated:
the stage programs stay plain jitted functions of the values handed between
threads.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import jax
from jax import tree_util

from jaxstreams._jit import jit as streams_jit
from jaxstreams.staging import _clock
from jaxstreams.staging._analysis import FUNC, Split
from jaxstreams.staging._meter import Meter
from jaxstreams.staging._splits import Splits
from jaxstreams.staging._prefetcher import Prefetcher
from jaxstreams.tag import stream as stream_scope


def jit_parts(stream: int | None, consumer_jit: Callable
              ) -> Callable[[Split], None]:
  """What thread mode makes of a split's functions: each producer stage
  jitted (a ``jaxstreams.jit`` program on ``stream`` when one is given), the
  consumer jitted as the step was (``consumer_jit``)."""
  def jit(split: Split) -> None:
    fns = []
    for body in split.bodies[:-1]:
      if body is None:
        fns.append(None)
      elif stream is None:
        fns.append(jax.jit(body))
      else:
        def run(*xs, body=body):
          with stream_scope(stream):
            return body(*xs)
        # The producer as a region on its stream, run the way
        # jaxstreams_gpu_lowering says; mode="measured" measures whether it
        # pays.
        fns.append(streams_jit(run, streams=stream + 1))
    fns.append(consumer_jit(split.bodies[-1]))
    split.fns = fns
  return jit


class ThreadRun:
  """The worker pipeline of one runner: reader, then one worker per
  producer stage. Made by the first call with its other arguments and the
  first batch read in the caller's thread, so a planning error is raised by
  the first call."""


  def __init__(self, splits: Splits, data: Iterable[Any], capacity: int,
               other: tuple):
    self.splits = splits
    self.stages: list[Prefetcher] = []
    # Counts calls; never steps aside (no chooser, nothing to tell).
    self.meter = Meter(("threads",), None, ("calls", "call_us", "read_us"))
    iterator = iter(data)
    first = next(iterator)          # StopIteration: no data, nothing to run
    splits.use_other(other)
    self.last_split = splits.split_for(first)
    # The workers hold ``splits`` and their items, never this object nor
    # the runner: an abandoned runner is collected and its workers stop.
    reader = self._pipe(_chain(first, iterator), capacity, _identity)
    pipe = self._pipe(reader, capacity, functools.partial(_first_stage, splits))
    for index in range(1, splits.n_producers):
      pipe = self._pipe(pipe, capacity, functools.partial(_later_stage, index))
    self.pipeline = pipe

  def _pipe(self, items, capacity: int, transform) -> Prefetcher:
    pipe = Prefetcher(items, capacity, transform=transform)
    self.stages.append(pipe)
    return pipe

  def call(self, other_args: tuple, kwargs: dict) -> Any:
    """The consumer for the next batch, in the caller's thread."""
    started = _clock.now()
    other_leaves = self.splits.check_other((other_args, kwargs))
    split, env = next(self.pipeline)
    carried = [env[v] for v in split.stage_ins[-1]]
    outs = split.fns[-1](*other_leaves, *carried)
    self.last_split = split
    now = _clock.now()
    self.meter.count("threads", now - started, 0.0, 0.0, False, now)
    return tree_util.tree_unflatten(split.out_tree, outs)

  def stats(self) -> dict[str, Any]:
    return self.meter.report("threads", "mode='threads' was asked for")

  def close(self) -> None:
    for pipe in reversed(self.stages):
      pipe.close()


def _first_stage(splits: Splits, batch: Any):
  split = splits.split_for(batch)
  # The host-to-device copy happens here, in the worker, not in the step.
  env = split.batch_env(jax.device_put(tree_util.tree_leaves(batch)))
  return _run_stage(split, env, 0)


def _later_stage(index: int, item):
  split, env = item
  return _run_stage(split, env, index)


def _run_stage(split: Split, env: dict, s: int):
  fn = split.fns[s]
  if fn is not None:
    outs = fn(*(env[v] for v in split.stage_ins[s]))
    # Ready before handed on: the next stage (or the step) never waits on
    # it, and ``capacity`` counts finished items.
    outs = jax.block_until_ready(outs)
    env = {**env, **dict(zip(split.stage_outs[s], outs))}
  keep = split.keep_after[s]
  return split, {v: x for v, x in env.items() if v in keep}


def _identity(item: Any) -> Any:
  return item


def _chain(first: Any, rest):
  """``first``, then ``rest``'s items (a generator, so closing it closes
  ``rest`` too when that is a generator)."""
  yield first
  yield from rest
