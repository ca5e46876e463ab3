"""A DLRM-style recommender: dense features through a bottom MLP, one tower
per sparse feature (embedding lookup, sum over a multi-hot bag, a small
MLP), pairwise dot-product interaction of all tower outputs, a top MLP.

Tower ``t`` runs on stream ``t % streams``; the bottom MLP, interaction and
top MLP on the main stream. ``mode="infer"`` is the forward pass;
``mode="train"`` is a full SGD step (value_and_grad), where jaxstreams puts
each tower's gradient on the tower's stream.
"""

import jax
import jax.numpy as jnp

from . import common

NAME = "dlrm"
DENSE = 13


def sizes(quick):
  if quick:
    return [dict(mode="train", towers=4, batch=8, vocab=64, dim=8, hot=2,
                 hidden=16)]
  base = dict(batch=256, vocab=4096, dim=32, hot=4, hidden=128)
  return [dict(mode=m, towers=t, **base) for m in ("infer", "train")
          for t in (8, 16)]


def _mlp(ws, x, last_act=True):
  for i, w in enumerate(ws):
    x = x @ w
    if last_act or i < len(ws) - 1:
      x = jax.nn.relu(x)
  return x


def init(key, size):
  d, h, t = size["dim"], size["hidden"], size["towers"]
  ks = iter(jax.random.split(key, 8 + 3 * t))

  def lin(i, o):
    return common.normal(next(ks), (i, o), i ** -0.5)

  n_int = (t + 1) * t // 2
  return {
      "bottom": [lin(DENSE, h), lin(h, d)],
      "tables": [common.normal(next(ks), (size["vocab"], d), 0.1)
                 for _ in range(t)],
      "towers": [[lin(d, h), lin(h, d)] for _ in range(t)],
      "top": [lin(n_int + d, h), lin(h, h // 2), lin(h // 2, 1)],
  }


def _tower(table, ws, ids):
  bag = jnp.take(table, ids, axis=0).sum(axis=1)     # (batch, dim)
  return _mlp(ws, bag)


def make_fn(size, streams):
  t = size["towers"]

  def build(place):
    def logits(params, dense, ids):
      z = _mlp(params["bottom"], dense)
      feats = [z] + [place(common.stream_for(i, streams), _tower,
                           params["tables"][i], params["towers"][i], ids[i])
                     for i in range(t)]
      stacked = jnp.stack(feats, axis=1)             # (batch, t+1, dim)
      inter = jnp.einsum("bid,bjd->bij", stacked, stacked)
      iu, ju = jnp.triu_indices(t + 1, k=1)
      top_in = jnp.concatenate([z, inter[:, iu, ju]], axis=1)
      return _mlp(params["top"], top_in, last_act=False)[:, 0]

    if size["mode"] == "infer":
      return lambda params, dense, ids, labels: jax.nn.sigmoid(
          logits(params, dense, ids))

    def step(params, dense, ids, labels):
      def loss(p):
        lg = logits(p, dense, ids)
        return jnp.mean(jnp.maximum(lg, 0) - lg * labels +
                        jnp.log1p(jnp.exp(-jnp.abs(lg))))
      value, grads = jax.value_and_grad(loss)(params)
      new = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads)
      return new, value
    return step
  return build


def model(size, streams, key):
  """(make_fn, args): the model written against a placement, and its inputs."""
  params = init(key, size)
  b = size["batch"]
  dense = common.normal(jax.random.fold_in(key, 1), (b, DENSE))
  ids = jax.random.randint(jax.random.fold_in(key, 2),
                           (size["towers"], b, size["hot"]), 0, size["vocab"])
  labels = (jax.random.uniform(jax.random.fold_in(key, 3), (b,)) < 0.3
            ).astype(jnp.float32)
  return make_fn(size, streams), (params, dense, ids, labels)


def build(size, streams, key):
  fn, args = model(size, streams, key)
  return common.standard_case(
      NAME, size, fn, args, streams,
      f"{size['towers']} towers over streams 0..{streams - 1}")
