"""An Inception-style stack of multi-branch blocks (inference).

Each block has four branches on the same input, concatenated on channels:
  0: 1x1 conv
  1: 1x1 conv -> 3x3 conv
  2: 1x1 conv -> 3x3 conv -> 3x3 conv   (the factorised 5x5)
  3: 3x3 max-pool -> 1x1 conv
Branch k runs on stream ``k % streams`` (branch 0 on the main stream); the
concatenation joins them. NHWC, float32, ReLU after each conv.
"""

import jax
import jax.numpy as jnp
from jax import lax

from . import common

NAME = "inception"
BRANCHES = 4


def sizes(quick):
  if quick:
    return [dict(batch=1, hw=8, channels=16, blocks=1)]
  return [dict(batch=b, hw=17, channels=64, blocks=4) for b in (1, 8, 32, 128)]


def _conv(x, w):
  return jax.nn.relu(lax.conv_general_dilated(
      x, w, window_strides=(1, 1), padding="SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC")))


def _pool(x):
  return lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1),
                           "SAME")


def init(key, channels, blocks):
  c = channels
  q = c // 4          # each branch's output channels; the block keeps c
  r = max(q // 2, 4)  # the reduction width before the larger convs

  def w(k, kh, cin, cout):
    return common.normal(k, (kh, kh, cin, cout), (kh * kh * cin) ** -0.5)

  params = []
  for b in range(blocks):
    k = jax.random.split(jax.random.fold_in(key, b), 7)
    params.append({
        "b0": [w(k[0], 1, c, q)],
        "b1": [w(k[1], 1, c, q), w(k[2], 3, q, q)],
        "b2": [w(k[3], 1, c, r), w(k[4], 3, r, q), w(k[5], 3, q, q)],
        "b3": [w(k[6], 1, c, q)],
    })
  return params


def _branch(index):
  def fn(x, ws):
    if index == 3:
      x = _pool(x)
    for w in ws:
      x = _conv(x, w)
    return x
  return fn


def make_fn(streams):
  def build(place):
    def forward(params, x):
      for block in params:
        outs = [place(common.stream_for(i, streams), _branch(i), x,
                      block[f"b{i}"]) for i in range(BRANCHES)]
        x = jnp.concatenate(outs, axis=-1)
      return jnp.mean(x, axis=(1, 2))
    return forward
  return build


def model(size, streams, key):
  """(make_fn, args): the model written against a placement, and its inputs."""
  params = init(key, size["channels"], size["blocks"])
  x = common.normal(jax.random.fold_in(key, 99),
                    (size["batch"], size["hw"], size["hw"], size["channels"]))
  return make_fn(streams), (params, x)


def build(size, streams, key):
  fn, args = model(size, streams, key)
  return common.standard_case(
      NAME, size, fn, args, streams,
      f"{BRANCHES} branches per block on streams "
      f"{sorted({common.stream_for(i, streams) for i in range(BRANCHES)})}")
