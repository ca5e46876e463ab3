"""An ensemble of neural ODEs, each solved with fixed-step RK4 in a
``fori_loop`` of static bounds (which jax runs as a ``lax.scan``): uncertainty
estimates, or several dynamics models, integrated side by side.

Member ``k`` runs on stream ``k % streams``; the final states are stacked to
(K, batch, dim).
"""

import jax
import jax.numpy as jnp
from jax import lax

from . import common

NAME = "ode_ensemble"


def sizes(quick):
  if quick:
    return [dict(members=2, batch=4, dim=8, width=16, steps=4)]
  return [dict(members=k, batch=64, dim=32, width=256, steps=50)
          for k in (4, 8)]


def init(key, size):
  d, w = size["dim"], size["width"]
  members = []
  for k in range(size["members"]):
    ks = jax.random.split(jax.random.fold_in(key, k), 2)
    members.append({"w1": common.normal(ks[0], (d, w), d ** -0.5),
                    "b1": jnp.zeros((w,), jnp.float32),
                    "w2": common.normal(ks[1], (w, d), w ** -0.5)})
  return members


def solve(params, y0, steps):
  """RK4 on dy/dt = f(y) over t in [0, 1], ``steps`` fixed steps."""
  def f(y):
    return jnp.tanh(y @ params["w1"] + params["b1"]) @ params["w2"]

  dt = 1.0 / steps

  def step(_, y):
    k1 = f(y)
    k2 = f(y + 0.5 * dt * k1)
    k3 = f(y + 0.5 * dt * k2)
    k4 = f(y + dt * k3)
    return y + dt / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)

  return lax.fori_loop(0, steps, step, y0)


def make_fn(size, streams):
  def build(place):
    def member(params, y0):   # the step count stays static
      return solve(params, y0, size["steps"])

    def ensemble(members, y0):
      return jnp.stack([place(common.stream_for(k, streams), member, m, y0)
                        for k, m in enumerate(members)])
    return ensemble
  return build


def model(size, streams, key):
  """(make_fn, args): the model written against a placement, and its inputs."""
  members = init(key, size)
  y0 = common.normal(jax.random.fold_in(key, 5), (size["batch"], size["dim"]))
  return make_fn(size, streams), (members, y0)


def build(size, streams, key):
  fn, args = model(size, streams, key)
  return common.standard_case(
      NAME, size, fn, args, streams,
      f"{size['members']} RK4 solves of {size['steps']} steps over "
      f"streams 0..{min(streams, size['members']) - 1}")
