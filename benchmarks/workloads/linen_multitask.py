"""A multi-task model written with ``flax.linen``: a shared trunk and one
head per task, each head a deep residual MLP stacked with ``nn.scan``,
trained with optax's ``adamw`` on the sum of the tasks' losses.

Head k runs on stream k + 1 (``common.stream_for`` with fewer streams).
``mode="forward"`` returns every task's prediction; ``mode="train"`` one
optax step: the loss, the new parameters and the new optimizer state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import common
from .linen_dual_encoder import optimizer

NAME = "linen_multitask"


def sizes(quick):
  if quick:
    return [dict(batch=8, features=16, width=32, tasks=3, depth=3, out=4,
                 mode="train")]
  return [dict(batch=64, features=256, width=512, tasks=3, depth=12, out=16,
               mode=m) for m in ("forward", "train")]


@functools.cache
def modules():
  """The flax.linen modules (defined on first use: flax is imported then)."""
  import flax.linen as nn

  class Residual(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, _):
      h = nn.LayerNorm(epsilon=1e-6)(x)
      h = nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(h)))
      return x + h, None

  class Head(nn.Module):
    depth: int
    width: int
    out: int

    @nn.compact
    def __call__(self, x):
      stack = nn.scan(Residual, variable_axes={"params": 0},
                      split_rngs={"params": True}, length=self.depth)
      x, _ = stack(self.width, name="layers")(x, None)
      return nn.Dense(self.out, name="readout")(x)

  class MultiTask(nn.Module):
    tasks: int
    depth: int
    width: int
    out: int
    place: object = common.place_none
    streams: int = 4

    @nn.compact
    def __call__(self, x):
      trunk = nn.gelu(nn.Dense(self.width, name="trunk")(x))
      return tuple(
          self.place(common.stream_for(k + 1, self.streams),
                     Head(self.depth, self.width, self.out, name=f"task{k}"),
                     trunk)
          for k in range(self.tasks))

  return {"MultiTask": MultiTask}


def make_fn(size, streams):
  def build(place):
    net = modules()["MultiTask"](size["tasks"], size["depth"], size["width"],
                                 size["out"], place, streams)

    def forward(params, x, targets):
      del targets
      return net.apply({"params": params}, x)

    def loss(params, x, targets):
      return sum(jnp.mean((y - t) ** 2)
                 for y, t in zip(forward(params, x, None), targets))

    if size["mode"] == "forward":
      return forward
    return common.optax_train_step(loss, optimizer())
  return build


def model(size, streams, key):
  k = jax.random.split(key, size["tasks"] + 1)
  x = common.normal(k[0], (size["batch"], size["features"]))
  targets = tuple(common.normal(kk, (size["batch"], size["out"]))
                  for kk in k[1:])
  net = modules()["MultiTask"](size["tasks"], size["depth"], size["width"],
                               size["out"])
  params = net.init(key, x)["params"]
  if size["mode"] == "forward":
    return make_fn(size, streams), (params, x, targets)
  return make_fn(size, streams), (params, optimizer().init(params), x, targets)


def build(size, streams, key):
  fn, args = model(size, streams, key)
  return common.standard_case(
      NAME, size, fn, args, streams,
      f"flax.linen trunk and {size['tasks']} heads of {size['depth']} "
      f"nn.scan layers ({size['mode']})")
