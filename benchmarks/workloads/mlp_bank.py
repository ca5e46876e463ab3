"""A bank of K small independent MLPs on one input (an ensemble).

Model ``k`` runs on stream ``k % streams``; the outputs are stacked to
(K, batch, out). Extra baseline: ``jax.vmap`` of one MLP over the stacked
parameters, the usual way to run such a bank as one wide program.
"""

import jax
import jax.numpy as jnp

from . import common

NAME = "mlp_bank"


def sizes(quick):
  if quick:
    return [dict(models=4, batch=4, width=16, depth=2, d_in=8, d_out=4)]
  base = dict(batch=32, width=128, depth=3, d_in=64, d_out=8)
  return [dict(models=k, **base) for k in (8, 16, 32)]


def init(key, size):
  dims = [size["d_in"]] + [size["width"]] * size["depth"] + [size["d_out"]]
  models = []
  for k in range(size["models"]):
    ks = jax.random.split(jax.random.fold_in(key, k), len(dims) - 1)
    models.append([(common.normal(ks[i], (dims[i], dims[i + 1]),
                                  dims[i] ** -0.5),
                    jnp.zeros((dims[i + 1],), jnp.float32))
                   for i in range(len(dims) - 1)])
  return models


def mlp(layers, x):
  for i, (w, b) in enumerate(layers):
    x = x @ w + b
    if i < len(layers) - 1:
      x = jnp.tanh(x)
  return x


def make_fn(streams):
  def build(place):
    def bank(models, x):
      return jnp.stack([place(common.stream_for(k, streams), mlp, m, x)
                        for k, m in enumerate(models)])
    return bank
  return build


def model(size, streams, key):
  """(make_fn, args): the model written against a placement, and its inputs."""
  models = init(key, size)
  x = common.normal(jax.random.fold_in(key, 7), (size["batch"], size["d_in"]))
  return make_fn(streams), (models, x)


def build(size, streams, key):
  fn, (models, x) = model(size, streams, key)
  cands = common.standard_candidates(fn, (models, x), streams)
  stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *models)
  vmapped = jax.jit(jax.vmap(mlp, in_axes=(0, None)))
  cands["jax.vmap"] = common.compiled_candidate("jax.vmap", vmapped,
                                                (stacked, x))
  return common.Case(
      workload=NAME, size=size, candidate="jaxstreams",
      baselines=list(common.STANDARD_BASELINES) + ["jax.vmap"],
      candidates=cands,
      notes=f"{size['models']} models over streams 0..{streams - 1}; "
            "jax.vmap runs one MLP over stacked parameters")
