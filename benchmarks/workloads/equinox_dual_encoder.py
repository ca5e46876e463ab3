"""A CLIP-style dual encoder written with equinox, scanning over its layers.

How equinox users write a deep stack: the blocks (``eqx.nn.MultiheadAttention``
and an MLP) made by ``eqx.filter_vmap`` over split keys (one module whose
arrays carry a leading axis of ``depth``), run by ``lax.scan`` over the
arrays with the static rest put back in each step (``eqx.partition`` /
``eqx.combine``). Modules work on one example; the towers ``jax.vmap`` over
the batch. A training step applies optax's ``adamw`` to the model's arrays.
A size's ``wrap`` (``"plain"`` where absent) may put each tower in
``eqx.filter_checkpoint`` or ``eqx.filter_jit``.

The model is called as ``model(patches, tokens, place)``: the placement
(``common.place_*``) puts the image tower on stream 1 and the text tower on
stream 2. ``train_step(model, opt_state, patches, tokens)`` is what users
give ``eqx.filter_jit`` (and ``jaxstreams.filter_jit``); ``make_fn`` is the
function of arrays the suite compiles (``eqx.partition`` of the model).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import common
from .linen_dual_encoder import (PATCH, VOCAB, contrastive_loss,
                                 dual_encoder_sizes, inputs, optimizer)

NAME = "equinox_dual_encoder"
# How each tower is wrapped: as is, in ``eqx.filter_checkpoint`` (its
# activations recomputed in the backward pass, as large models train), or
# in ``eqx.filter_jit`` (a jitted helper called inside the jitted step).
WRAPS = ("plain", "checkpoint", "jit")


def sizes(quick):
  return dual_encoder_sizes(quick)


@functools.cache
def modules():
  """The equinox modules (defined on first use: equinox is imported then)."""
  import equinox as eqx

  class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width, heads, key):
      k = jax.random.split(key, 3)
      self.ln1 = eqx.nn.LayerNorm(width, eps=1e-6)
      self.attn = eqx.nn.MultiheadAttention(heads, width, key=k[0])
      self.ln2 = eqx.nn.LayerNorm(width, eps=1e-6)
      self.up = eqx.nn.Linear(width, 4 * width, key=k[1])
      self.down = eqx.nn.Linear(4 * width, width, key=k[2])

    def __call__(self, x):   # x: (sequence, width)
      h = jax.vmap(self.ln1)(x)
      x = x + self.attn(h, h, h)
      h = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(x)))
      return x + jax.vmap(self.down)(h)

  class Tower(eqx.Module):
    blocks: Block          # every array with a leading axis of depth
    position: jax.Array

    def __init__(self, depth, width, heads, length, key):
      k = jax.random.split(key)
      self.blocks = eqx.filter_vmap(lambda k: Block(width, heads, k))(
          jax.random.split(k[0], depth))
      self.position = jax.random.normal(k[1], (length, width)) * 0.02

    def __call__(self, x):   # x: (batch, sequence, width)
      arrays, static = eqx.partition(self.blocks, eqx.is_array)

      def layer(h, block_arrays):
        return jax.vmap(eqx.combine(block_arrays, static))(h), None
      h, _ = lax.scan(layer, x + self.position, arrays)
      e = jnp.mean(h, axis=1)
      return e / jnp.linalg.norm(e, axis=-1, keepdims=True)

  class DualEncoder(eqx.Module):
    patch_embed: eqx.nn.Linear
    token_embed: eqx.nn.Embedding
    image: Tower
    text: Tower
    wrap: str = eqx.field(static=True)

    def __init__(self, depths, width, heads, patches, tokens, key,
                 wrap="plain"):
      if wrap not in WRAPS:
        raise ValueError(f"wrap={wrap!r}: one of {WRAPS}")
      self.wrap = wrap
      k = jax.random.split(key, 4)
      self.patch_embed = eqx.nn.Linear(PATCH, width, key=k[0])
      self.token_embed = eqx.nn.Embedding(VOCAB, width, key=k[1])
      self.image = Tower(depths[0], width, heads, patches, k[2])
      self.text = Tower(depths[1], width, heads, tokens, k[3])

    def __call__(self, patches, tokens, place=common.place_none, streams=3):
      embed_patches = jax.vmap(jax.vmap(self.patch_embed))
      embed_tokens = jax.vmap(jax.vmap(self.token_embed))
      image_tower, text_tower = self.image, self.text
      if self.wrap != "plain":
        wrap = {"checkpoint": eqx.filter_checkpoint,
                "jit": eqx.filter_jit}[self.wrap]
        image_tower, text_tower = wrap(image_tower), wrap(text_tower)
      image = place(common.stream_for(1, streams),
                    lambda p: image_tower(embed_patches(p)), patches)
      text = place(common.stream_for(2, streams),
                   lambda t: text_tower(embed_tokens(t)), tokens)
      return image, text

  return {"Block": Block, "Tower": Tower, "DualEncoder": DualEncoder}


def create(size, key):
  """(model, opt_state) for a size, from a PRNG key."""
  import equinox as eqx
  model = modules()["DualEncoder"](tuple(size["depths"]), size["width"],
                                   size["heads"], size["patches"],
                                   size["tokens"], key,
                                   size.get("wrap", "plain"))
  return model, optimizer().init(eqx.filter(model, eqx.is_array))


def train_step_for(place=common.place_none, streams=3):
  """The training step as equinox users write it: returns the loss, the
  new model and the new optimizer state."""
  import equinox as eqx

  def train_step(model, opt_state, patches, tokens):
    def loss_fn(model):
      return contrastive_loss(*model(patches, tokens, place, streams))
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = optimizer().update(
        grads, opt_state, eqx.filter(model, eqx.is_array))
    return loss, eqx.apply_updates(model, updates), opt_state
  return train_step


def make_fn(size, streams, static):
  """``build(place)``: the forward pass or the training step as a function
  of the model's arrays (``static`` the rest), [the optimizer state,] and
  the batch."""
  import equinox as eqx

  def build(place):
    def forward(arrays, patches, tokens):
      return eqx.combine(arrays, static)(patches, tokens, place, streams)

    def train(arrays, opt_state, patches, tokens):
      loss, model, opt_state = train_step_for(place, streams)(
          eqx.combine(arrays, static), opt_state, patches, tokens)
      return loss, eqx.filter(model, eqx.is_array), opt_state

    return forward if size["mode"] == "forward" else train
  return build


def model(size, streams, key):
  """(make_fn, args): the model written against a placement, and its inputs."""
  import equinox as eqx
  net, opt_state = create(size, key)
  arrays, static = eqx.partition(net, eqx.is_array)
  batch = inputs(size, key)
  args = ((arrays, *batch) if size["mode"] == "forward"
          else (arrays, opt_state, *batch))
  return make_fn(size, streams, static), args


def build(size, streams, key):
  fn, args = model(size, streams, key)
  return common.standard_case(
      NAME, size, fn, args, streams,
      f"equinox towers of {size['depths'][0]} and {size['depths'][1]} "
      f"scanned layers ({size['mode']})")
