"""A bank of recurrent models: K independent GRUs over the same sequence,
each a ``lax.scan`` over time steps (a per-user or per-feature sequence
model bank, an ensemble of forecasters).

Model ``k`` runs on stream ``k % streams``; the last hidden states are
stacked to (K, batch, hidden). ``mode="train"`` returns the mean squared
error against a target and its gradients.
"""

import jax
import jax.numpy as jnp
from jax import lax

from . import common

NAME = "gru_bank"


def sizes(quick):
  if quick:
    return [dict(models=2, batch=4, inputs=8, hidden=16, steps=6,
                 mode="train")]
  return [dict(models=k, batch=16, inputs=64, hidden=256, steps=64, mode=m)
          for m in ("forward", "train") for k in (4, 8)]


def init(key, size):
  i, h = size["inputs"], size["hidden"]
  models = []
  for k in range(size["models"]):
    ks = jax.random.split(jax.random.fold_in(key, k), 2)
    models.append({"wx": common.normal(ks[0], (i, 3 * h), i ** -0.5),
                   "wh": common.normal(ks[1], (h, 3 * h), h ** -0.5),
                   "b": jnp.zeros((3 * h,), jnp.float32)})
  return models


def gru(params, xs):
  """The last hidden state of a GRU run over ``xs`` (steps, batch, inputs)."""
  hidden = params["wh"].shape[0]

  def step(h, x):
    gx = x @ params["wx"] + params["b"]
    gh = h @ params["wh"]
    r = jax.nn.sigmoid(gx[:, :hidden] + gh[:, :hidden])
    z = jax.nn.sigmoid(gx[:, hidden:2 * hidden] + gh[:, hidden:2 * hidden])
    n = jnp.tanh(gx[:, 2 * hidden:] + r * gh[:, 2 * hidden:])
    return (1 - z) * n + z * h, None

  h0 = jnp.zeros((xs.shape[1], hidden), xs.dtype)
  return lax.scan(step, h0, xs)[0]


def make_fn(size, streams):
  def build(place):
    def bank(models, xs):
      return jnp.stack([place(common.stream_for(k, streams), gru, m, xs)
                        for k, m in enumerate(models)])

    def loss(models, xs, target):
      return jnp.mean(jnp.square(bank(models, xs) - target))

    if size["mode"] == "forward":
      return lambda models, xs, target: bank(models, xs)
    return jax.value_and_grad(loss)
  return build


def model(size, streams, key):
  """(make_fn, args): the model written against a placement, and its inputs."""
  models = init(key, size)
  k = jax.random.split(jax.random.fold_in(key, 7))
  xs = common.normal(k[0], (size["steps"], size["batch"], size["inputs"]))
  target = common.normal(k[1], (size["models"], size["batch"], size["hidden"]))
  return make_fn(size, streams), (models, xs, target)


def build(size, streams, key):
  fn, args = model(size, streams, key)
  return common.standard_case(
      NAME, size, fn, args, streams,
      f"{size['models']} GRUs of {size['steps']} steps ({size['mode']}) "
      f"over streams 0..{min(streams, size['models']) - 1}")
