"""A CLIP-style dual encoder written with ``flax.linen``, trained with optax.

How flax users write one: each tower a pre-norm transformer whose blocks
(``nn.MultiHeadDotProductAttention`` and an MLP) are stacked with
``nn.scan`` (one ``lax.scan`` over layer parameters stacked on a leading
axis), an image tower over patch features and a text tower over tokens, a
contrastive loss, and a training step that applies optax's ``adamw``. The
towers may differ in depth (a ViT-L/14 image tower has 24 layers, its text
tower 12) and may be wrapped whole the way large models are trained:
``nn.remat`` (``jax.checkpoint`` of the tower) or ``nn.jit`` (a jitted
tower).

The module takes a placement (``common.place_*``): the image tower runs
on stream 1 and the text tower on stream 2 (``common.stream_for`` with
fewer streams). ``mode="forward"`` returns the two normalized embeddings;
``mode="train"`` one optax step: the loss, the new parameters and the new
optimizer state.

``flax`` and ``optax`` are imported when a model is built, so the suite's
other workloads run without them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from . import common

NAME = "linen_dual_encoder"
VOCAB = 256
PATCH = 48   # flattened patch features (a 4x4 RGB patch)
WRAPS = ("plain", "remat", "jit")


# A CLIP-sized dual encoder's shapes, but its depths and mode.
CLIP_SHAPES = dict(batch=32, width=512, heads=8, patches=50, tokens=32)


def dual_encoder_sizes(quick, **extra):
  """The sizes of the dual encoders written with each library (linen, nnx,
  equinox), each with the keys ``extra`` adds."""
  if quick:
    return [dict(batch=4, width=32, heads=2, depths=(2, 2), patches=8,
                 tokens=8, mode="train", **extra)]
  return [dict(CLIP_SHAPES, depths=d, mode=m, **extra)
          for d in ((12, 12), (24, 12)) for m in ("forward", "train")]


def sizes(quick):
  return dual_encoder_sizes(quick, wrap="plain")


@functools.cache
def modules():
  """The flax.linen modules (defined on first use: flax is imported then)."""
  import flax.linen as nn

  class Block(nn.Module):
    """Pre-norm attention and MLP; ``(x, None)`` as ``nn.scan`` wants."""
    width: int
    heads: int

    @nn.compact
    def __call__(self, x, _):
      h = nn.LayerNorm(epsilon=1e-6, name="ln1")(x)
      x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads,
                                              name="attn")(h, h)
      h = nn.LayerNorm(epsilon=1e-6, name="ln2")(x)
      h = nn.gelu(nn.Dense(4 * self.width, name="up")(h))
      return x + nn.Dense(self.width, name="down")(h), None

  class Tower(nn.Module):
    """Positions added, ``depth`` blocks in one ``nn.scan``, mean-pooled and
    normalized."""
    depth: int
    width: int
    heads: int

    @nn.compact
    def __call__(self, x):
      position = self.param("position", nn.initializers.normal(0.02),
                            x.shape[1:])
      blocks = nn.scan(Block, variable_axes={"params": 0},
                       split_rngs={"params": True}, length=self.depth)
      x, _ = blocks(self.width, self.heads, name="blocks")(x + position, None)
      e = jnp.mean(x, axis=1)
      return e / jnp.linalg.norm(e, axis=-1, keepdims=True)

  wrapped = {"plain": Tower, "remat": nn.remat(Tower), "jit": nn.jit(Tower)}

  class DualEncoder(nn.Module):
    depths: tuple[int, int]
    width: int
    heads: int
    wrap: str = "plain"
    place: Callable = common.place_none
    streams: int = 3

    @nn.compact
    def __call__(self, patches, tokens):
      tower = wrapped[self.wrap]
      image_tower = tower(self.depths[0], self.width, self.heads, name="image")
      text_tower = tower(self.depths[1], self.width, self.heads, name="text")
      patch_embed = nn.Dense(self.width, name="patch_embed")
      token_embed = nn.Embed(VOCAB, self.width, name="token_embed")
      image = self.place(common.stream_for(1, self.streams),
                         lambda p: image_tower(patch_embed(p)), patches)
      text = self.place(common.stream_for(2, self.streams),
                        lambda t: text_tower(token_embed(t)), tokens)
      return image, text

  return {"Block": Block, "Tower": Tower, "DualEncoder": DualEncoder}


def contrastive_loss(image, text, scale=10.0):
  """CLIP's symmetric cross-entropy over the batch's image-text pairs."""
  logits = scale * image @ text.T
  labels = jnp.arange(logits.shape[0])
  lse = lambda z: jax.nn.logsumexp(z, axis=-1)
  diagonal = logits[labels, labels]
  return 0.5 * jnp.mean(lse(logits) - diagonal + lse(logits.T) - diagonal)


def optimizer():
  import optax
  return optax.adamw(1e-3, weight_decay=1e-4)


def inputs(size, key):
  """(patches, tokens) for a batch."""
  k = jax.random.split(jax.random.fold_in(key, 99))
  patches = common.normal(k[0], (size["batch"], size["patches"], PATCH))
  tokens = jax.random.randint(k[1], (size["batch"], size["tokens"]), 0, VOCAB)
  return patches, tokens


def make_fn(size, streams):
  """``build(place)``: the forward pass or the training step with placement
  ``place``, as a function of (params, [opt_state,] patches, tokens)."""
  def build(place):
    model = modules()["DualEncoder"](tuple(size["depths"]), size["width"],
                                     size["heads"], size.get("wrap", "plain"),
                                     place, streams)

    def forward(params, patches, tokens):
      return model.apply({"params": params}, patches, tokens)

    def loss(params, patches, tokens):
      return contrastive_loss(*forward(params, patches, tokens))

    if size["mode"] == "forward":
      return forward
    return common.optax_train_step(loss, optimizer())
  return build


def model(size, streams, key):
  """(make_fn, args): the model written against a placement, and its inputs."""
  patches, tokens = inputs(size, key)
  module = modules()["DualEncoder"](tuple(size["depths"]), size["width"],
                                    size["heads"], size.get("wrap", "plain"))
  params = module.init(key, patches, tokens)["params"]
  if size["mode"] == "forward":
    return make_fn(size, streams), (params, patches, tokens)
  return make_fn(size, streams), (params, optimizer().init(params), patches,
                                  tokens)


def build(size, streams, key) -> Any:
  fn, args = model(size, streams, key)
  return common.standard_case(
      NAME, size, fn, args, streams,
      f"flax.linen towers of {size['depths'][0]} and {size['depths'][1]} "
      f"nn.scan layers ({size['mode']}, {size.get('wrap', 'plain')})")
