"""Negative control: one long chain of large matmuls, nothing to overlap.

``placement="main"`` leaves everything on stream 0 (no blocks, streams > 1);
``placement="one stream"`` puts the whole chain in ``stream(1)``. Either way
jaxstreams has nothing to run concurrently, so it must not be slower than
``jax.jit`` (the goal is a ratio of at least 0.98).
"""

import jax
import jax.numpy as jnp

from . import common

NAME = "control"


def sizes(quick):
  if quick:
    return [dict(placement="one stream", n=32, batch=8, depth=2)]
  return [dict(placement=p, n=512, batch=512, depth=8)
          for p in ("main", "one stream")]


def _chain(ws, x):
  for w in ws:
    x = jnp.tanh(x @ w)
  return x


def make_fn(size):
  stream = 0 if size["placement"] == "main" else 1

  def build(place):
    def forward(ws, x):
      return jnp.sum(place(stream, _chain, ws, x), axis=1)
    return forward
  return build


def model(size, streams, key):
  """(make_fn, args): the model written against a placement, and its inputs."""
  del streams   # one chain: one stream at most
  n = size["n"]
  ks = jax.random.split(key, size["depth"] + 1)
  ws = [common.normal(k, (n, n), n ** -0.5) for k in ks[1:]]
  x = common.normal(ks[0], (size["batch"], n))
  return make_fn(size), (ws, x)


def build(size, streams, key):
  _, (ws, x) = model(size, streams, key)
  return common.Case(
      workload=NAME, size=size, candidate="jaxstreams",
      baselines=list(common.STANDARD_BASELINES),
      candidates=common.standard_candidates(make_fn(size), (ws, x),
                                            max(streams, 2)),
      notes="nothing to overlap: must not get slower")
