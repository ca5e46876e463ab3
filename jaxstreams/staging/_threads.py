"""``staged(mode="threads")``: each producer stage a program run by a
``Prefetcher`` (``capacity`` finished items ahead) over the previous
stage's items, behind a reader thread; the consumer in the caller's thread.
The programs are the fused pipeline's, with one part each.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import jax
from jax import tree_util

from jaxstreams.staging import _clock
from jaxstreams.staging._analysis import Split
from jaxstreams.staging._fused import part_program, producer_stream
from jaxstreams.staging._policy import Meter
from jaxstreams.staging._splits import Splits
from jaxstreams.staging._prefetcher import Prefetcher


class ThreadRun:
  """Reader, then one worker per producer stage; made by the first call."""

  def __init__(self, splits: Splits, data: Iterable[Any], capacity: int,
               stream: int | None, streams_now: Callable[[], int],
               other: tuple):
    self.splits = splits
    self.stages: list[Prefetcher] = []
    self.meter = Meter(("threads",), None, ("calls", "call_us", "read_us"))
    self.way, self.reason = "threads", "mode='threads' was asked for"
    iterator = iter(data)
    first = next(iterator)          # StopIteration: no data, nothing to run
    splits.use_other(other)
    self.last_split = splits.split_for(first)
    self.stream, self.streams = producer_stream(self.last_split, stream,
                                                streams_now)
    run = functools.partial(part_program, splits.cache,
                            stream=self.stream, streams=self.streams)
    self.run = run
    # Workers never hold this object: an abandoned runner is collected.
    reader = self._pipe(_chain(first, iterator), capacity, lambda b: b)
    pipe = self._pipe(reader, capacity,
                      functools.partial(_first_stage, splits, run))
    for index in range(1, splits.n_producers):
      pipe = self._pipe(pipe, capacity,
                        functools.partial(_run_stage, run, index))
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
    k = len(split.bodies) - 1
    carried = [env[v] for v in split.stage_ins[k]]
    outs, _ = self.run(split, k)(*other_leaves, *carried)
    self.last_split = split
    now = _clock.now()
    self.meter.count("threads", now - started, 0.0, 0.0, False, now)
    return tree_util.tree_unflatten(split.out_tree, outs)

  def close(self) -> None:
    for pipe in reversed(self.stages):
      pipe.close()


def _first_stage(splits: Splits, run: Callable, batch: Any):
  split = splits.split_for(batch)
  # The host-to-device copy happens here, in the worker, not in the step.
  env = split.batch_env(jax.device_put(tree_util.tree_leaves(batch)))
  return _run_stage(run, 0, (split, env))


def _run_stage(run: Callable, s: int, item: tuple[Split, dict]):
  split, env = item
  if split.bodies[s] is not None:
    _, produced = run(split, s)(*(env[v] for v in split.stage_ins[s]))
    # Ready before handed on: ``capacity`` counts finished items.
    outs = jax.block_until_ready(produced[s])
    env = {**env, **dict(zip(split.stage_outs[s], outs))}
  keep = split.keep_after[s]
  return split, {v: x for v, x in env.items() if v in keep}


def _chain(first: Any, rest):
  """``first``, then ``rest``'s items (closing it closes ``rest``)."""
  yield first
  yield from rest
