"""Staging micro-benchmark: host numpy batches -> device_put -> compute.

The compute (a two-layer MLP on the batch, ``sum(tanh(x @ W1) @ W2)``) has
its hidden width chosen at build time so that one step's compute takes about
as long as one batch's host-to-device copy; both times are measured and
recorded with the results. Three loops over the same batches:

* ``no prefetch`` (baseline): copy batch i, then run step i.
* ``prefetch thread`` (baseline): a hand-written background thread copies
  batch i+1 (``device_put`` + ``block_until_ready``) while step i runs.
* ``jaxstreams.prefetch`` (the candidate): the loop over
  ``jaxstreams.prefetch(batches)`` in its default ``mode="measured"``, which
  runs workers only where they pay.

``sync="step"`` waits for each step's result (as a loop that reads its loss
does); ``sync="end"`` waits once, after the last step, so JAX's
asynchronous dispatch can already overlap copies and compute. Ratios are a
baseline's time / the candidate's time for the whole loop.
"""

import concurrent.futures
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jaxstreams

from . import common

NAME = "staging"


def sizes(quick):
  if quick:
    return [dict(sync="step", steps=3, rows=16, cols=32, width=8)]
  base = dict(steps=32, rows=2048, cols=512, width="calibrated")
  return [dict(sync=s, **base) for s in ("step", "end")]


def _step(ws, x, acc):
  w1, w2 = ws
  return acc + jnp.sum(jnp.tanh(x @ w1) @ w2)


def _median_time(fn, reps=9):
  fn()
  fn()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def _compile(ws, x, acc):
  return jax.jit(_step).lower(ws, x, acc).compile()


def build(size, streams, key):
  del streams
  rows, cols = size["rows"], size["cols"]
  rng = np.random.default_rng(0)
  host = [rng.standard_normal((rows, cols), dtype=np.float32)
          for _ in range(size["steps"])]
  acc0 = jnp.zeros((), jnp.float32)
  x0 = jax.device_put(host[0])

  def weights(width):
    k1, k2 = jax.random.split(key)
    return (common.normal(k1, (cols, width), cols ** -0.5),
            common.normal(k2, (width, 1), width ** -0.5))

  def compute_time(width):
    ws = weights(width)
    fn = _compile(ws, x0, acc0)
    return fn, ws, _median_time(lambda: fn(ws, x0, acc0).block_until_ready())

  batches = iter(range(10 ** 9))
  copy_s = _median_time(lambda: jax.device_put(
      host[next(batches) % len(host)]).block_until_ready())
  width = size["width"]
  if width == "calibrated":   # one step's compute about one batch's copy
    width = 64
    for _ in range(3):  # compute time is roughly linear in the width
      _, _, t = compute_time(width)
      width = int(min(8192, max(1, round(width * copy_s / t))))
  step, ws, compute_s = compute_time(width)
  sync_each = size["sync"] == "step"

  def serial():
    acc = acc0
    for batch in host:
      acc = step(ws, jax.device_put(batch), acc)
      if sync_each:
        acc.block_until_ready()
    return acc

  pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

  def load(i):
    return jax.device_put(host[i]).block_until_ready()

  def prefetched():
    acc = acc0
    pending = pool.submit(load, 0)
    for i in range(len(host)):
      x = pending.result()
      if i + 1 < len(host):
        pending = pool.submit(load, i + 1)
      acc = step(ws, x, acc)
      if sync_each:
        acc.block_until_ready()
    return acc

  chose = []       # each loop's stats(): what mode="measured" did

  def jaxstreams_prefetch():
    acc = acc0
    with warnings.catch_warnings():   # stepping aside is what is measured
      warnings.simplefilter("ignore", jaxstreams.PerformanceWarning)
      with jaxstreams.prefetch(host) as batches:
        for x in batches:
          acc = step(ws, x, acc)
          if sync_each:
            acc.block_until_ready()
        chose.append(batches.stats())
    return acc

  cands = {
      "jaxstreams.prefetch": common.Candidate(
          "jaxstreams.prefetch", run=jaxstreams_prefetch, compiled=step),
      "no prefetch": common.Candidate("no prefetch", run=serial,
                                      compiled=step),
      "prefetch thread": common.Candidate(
          "prefetch thread", run=prefetched, compiled=step,
          cleanup=lambda: pool.shutdown(wait=True)),
  }
  size = dict(size, width=width,
              batch_mib=round(rows * cols * 4 / 2 ** 20, 2),
              copy_ms=round(copy_s * 1e3, 3),
              compute_ms=round(compute_s * 1e3, 3))
  return common.Case(
      workload=NAME, size=size, candidate="jaxstreams.prefetch",
      baselines=["no prefetch", "prefetch thread"], candidates=cands,
      reference="no prefetch",
      notes="times are for the whole loop over all batches; the candidate is "
            "jaxstreams.prefetch (mode='measured'), the baselines the plain "
            "loop and a hand-written prefetch thread",
      chose=lambda: _what_measured_chose(chose))


def _what_measured_chose(stats: list[dict]) -> dict:
  """Over every loop the candidate ran (warm-up included): how many ended
  in each way, switched at all, ran trials; the last loop's reason."""
  ended = {}
  for s in stats:
    ended[s["mode"]] = ended.get(s["mode"], 0) + 1
  return {"loops": len(stats), "ended_in": ended,
          "loops_that_switched": sum(1 for s in stats if s["switches"]),
          "trials": sum(len(s["trials"]) for s in stats),
          "items_by_workers": sum(s["workers"]["items"] for s in stats),
          "items_inline": sum(s["inline"]["items"] for s in stats),
          "last_reason": stats[-1]["mode_reason"] if stats else None}
