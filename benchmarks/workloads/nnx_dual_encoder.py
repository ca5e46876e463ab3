"""A CLIP-style dual encoder written with ``flax.nnx``, trained with
``nnx.Optimizer`` (optax's ``adamw``).

How nnx users stack layers: a tower's blocks (``nnx.MultiHeadAttention``
and an MLP) are made by ``nnx.vmap`` over a split ``nnx.Rngs`` (one module
whose parameters carry a leading axis of ``depth``) and run by
``nnx.scan`` over that axis. Depths may differ between the towers.

The model is called as ``model(patches, tokens, place)``: the placement
(``common.place_*``) puts the image tower on stream 1 and the text tower
on stream 2. Two ways to call it:

* ``train_step(model, optimizer, patches, tokens)``, what users give
  ``nnx.jit`` (and ``jaxstreams.nnx_jit``): updates both in place, returns
  the loss;
* ``make_fn(size, streams)(place)``, nnx's functional form (``nnx.split`` /
  ``nnx.merge``) that the suite compiles: a function of the state arrays
  and the batch, returning the loss (``mode="train"``: and the new state;
  ``mode="forward"``: the two embeddings).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import common
from .linen_dual_encoder import (PATCH, VOCAB, contrastive_loss,
                                 dual_encoder_sizes, inputs, optimizer)

NAME = "nnx_dual_encoder"


def sizes(quick):
  return dual_encoder_sizes(quick)


@functools.cache
def modules():
  """The flax.nnx modules (defined on first use: flax is imported then)."""
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, width, heads, rngs):
      self.ln1 = nnx.LayerNorm(width, epsilon=1e-6, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=width,
                                         decode=False, rngs=rngs)
      self.ln2 = nnx.LayerNorm(width, epsilon=1e-6, rngs=rngs)
      self.up = nnx.Linear(width, 4 * width, rngs=rngs)
      self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
      x = x + self.attn(self.ln1(x))
      return x + self.down(nnx.gelu(self.up(self.ln2(x))))

  class Tower(nnx.Module):
    def __init__(self, depth, width, heads, length, rngs):
      @nnx.split_rngs(splits=depth)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def stack(rngs):
        return Block(width, heads, rngs)
      self.blocks = stack(rngs)
      self.position = nnx.Param(
          jax.random.normal(rngs.params(), (length, width)) * 0.02)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def run(x, block):
        return block(x)
      e = jnp.mean(run(x + self.position[...], self.blocks), axis=1)
      return e / jnp.linalg.norm(e, axis=-1, keepdims=True)

  class DualEncoder(nnx.Module):
    def __init__(self, depths, width, heads, patches, tokens, rngs):
      self.patch_embed = nnx.Linear(PATCH, width, rngs=rngs)
      self.token_embed = nnx.Embed(VOCAB, width, rngs=rngs)
      self.image = Tower(depths[0], width, heads, patches, rngs)
      self.text = Tower(depths[1], width, heads, tokens, rngs)

    def __call__(self, patches, tokens, place=common.place_none, streams=3):
      image = place(common.stream_for(1, streams),
                    lambda p: self.image(self.patch_embed(p)), patches)
      text = place(common.stream_for(2, streams),
                   lambda t: self.text(self.token_embed(t)), tokens)
      return image, text

  return {"Block": Block, "Tower": Tower, "DualEncoder": DualEncoder}


def create(size, key):
  """(model, optimizer) for a size, from a PRNG key."""
  from flax import nnx
  model = modules()["DualEncoder"](tuple(size["depths"]), size["width"],
                                   size["heads"], size["patches"],
                                   size["tokens"], nnx.Rngs(key))
  return model, nnx.Optimizer(model, optimizer(), wrt=nnx.Param)


def train_step_for(place=common.place_none, streams=3):
  """The training step as nnx users write it (modules updated in place)."""
  from flax import nnx

  def train_step(model, optimizer, patches, tokens):
    def loss_fn(model):
      return contrastive_loss(*model(patches, tokens, place, streams))
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss
  return train_step


def make_fn(size, streams, graphdef):
  """``build(place)``: nnx's functional form of the forward pass or the
  training step, for the modules split into ``graphdef`` and a state."""
  from flax import nnx

  def build(place):
    def forward(state, patches, tokens):
      model, _ = nnx.merge(graphdef, state)
      return model(patches, tokens, place, streams)

    def train(state, patches, tokens):
      model, optimizer = nnx.merge(graphdef, state)
      loss = train_step_for(place, streams)(model, optimizer, patches, tokens)
      return loss, nnx.state((model, optimizer))

    return forward if size["mode"] == "forward" else train
  return build


def model(size, streams, key):
  """(make_fn, args): the model written against a placement, and its inputs."""
  from flax import nnx
  graphdef, state = nnx.split(create(size, key))
  return make_fn(size, streams, graphdef), (state, *inputs(size, key))


def build(size, streams, key):
  fn, args = model(size, streams, key)
  return common.standard_case(
      NAME, size, fn, args, streams,
      f"flax.nnx towers of {size['depths'][0]} and {size['depths'][1]} "
      f"nnx.scan layers ({size['mode']})")
