"""A dual encoder (CLIP/SigLIP-style): an image tower and a text tower, each
a pre-norm transformer stack scanned over its layers (``lax.scan`` over
stacked layer parameters, as Flax's ``nn.scan`` and most JAX model code
write deep stacks), joined by a contrastive loss.

The image tower runs on stream 1, the text tower on stream 2 (with fewer
streams, ``common.stream_for``). ``mode="forward"`` returns the two
normalized embeddings; ``mode="train"`` returns the loss and the gradients
of every parameter (what a training step computes before the optimizer).

Real dual encoders differ in depth (a ViT-L/14 image tower has 24 layers,
its text tower 12): ``layers`` is the image tower's, ``text_layers`` (when
given) the text tower's. ``tower_wrap`` wraps each tower the way large
models are written: ``"checkpoint"`` (``jax.checkpoint`` of the whole
tower, recomputed in the backward pass) or ``"jit"`` (a ``jax.jit``
function, as flax's ``nn.jit`` and equinox's ``filter_jit`` make).
"""

import jax
import jax.numpy as jnp
from jax import lax

from . import common

NAME = "dual_encoder"
VOCAB = 1024
PATCH = 48   # flattened patch features (a 4x4 RGB patch)


def sizes(quick):
  if quick:
    return [dict(batch=8, width=64, heads=2, layers=2, patches=16, tokens=8,
                 mode="train")]
  return [dict(batch=b, width=512, heads=8, layers=12, patches=50, tokens=32,
               mode=m) for m in ("forward", "train") for b in (8, 64)]


def _layers(key, layers, width):
  """A tower's layer parameters, stacked on a leading axis of ``layers``."""
  k = jax.random.split(key, 4)
  ones, zeros = jnp.ones((layers, width)), jnp.zeros((layers, width))
  return {
      "ln1": (ones, zeros), "ln2": (ones, zeros),
      "qkv": common.normal(k[0], (layers, width, 3 * width), width ** -0.5),
      "out": common.normal(k[1], (layers, width, width), width ** -0.5),
      "up": common.normal(k[2], (layers, width, 4 * width), width ** -0.5),
      "down": common.normal(k[3], (layers, 4 * width, width),
                            (4 * width) ** -0.5),
  }


def depths(size):
  """(image tower layers, text tower layers)."""
  return size["layers"], size.get("text_layers", size["layers"])


def init(key, size):
  w = size["width"]
  image_layers, text_layers = depths(size)
  k = jax.random.split(key, 6)
  return {
      "image": {"embed": common.normal(k[0], (PATCH, w), PATCH ** -0.5),
                "position": common.normal(k[1], (size["patches"], w), 0.02),
                "layers": _layers(k[2], image_layers, w)},
      "text": {"embed": common.normal(k[3], (VOCAB, w), 0.02),
               "position": common.normal(k[4], (size["tokens"], w), 0.02),
               "layers": _layers(k[5], text_layers, w)},
      "scale": jnp.asarray(10.0),
  }


def _norm(x, scale_bias):
  scale, bias = scale_bias
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + 1e-6) * scale + bias


def _layer(heads):
  def layer(x, p):
    b, t, w = x.shape
    q, k, v = jnp.split(_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
    split = lambda a: a.reshape(b, t, heads, w // heads)
    scores = (jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k))
              * (w // heads) ** -0.5)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1),
                      split(v)).reshape(b, t, w)
    x = x + attn @ p["out"]
    x = x + jax.nn.gelu(_norm(x, p["ln2"]) @ p["up"]) @ p["down"]
    return x, None
  return layer


def _tower(heads):
  def tower(params, h):
    h = h + params["position"]
    h, _ = lax.scan(_layer(heads), h, params["layers"])
    e = jnp.mean(h, axis=1)
    return e / jnp.linalg.norm(e, axis=-1, keepdims=True)
  return tower


_WRAPS = {None: lambda f: f, "checkpoint": jax.checkpoint, "jit": jax.jit}


def _image_tower(heads, wrap=None):
  tower = _tower(heads)
  return _WRAPS[wrap](lambda params, patches: tower(params,
                                                    patches @ params["embed"]))


def _text_tower(heads, wrap=None):
  tower = _tower(heads)
  return _WRAPS[wrap](lambda params, tokens: tower(params,
                                                   params["embed"][tokens]))


def make_fn(size, streams):
  heads, wrap = size["heads"], size.get("tower_wrap")

  def build(place):
    def embed(params, patches, tokens):
      image = place(common.stream_for(1, streams), _image_tower(heads, wrap),
                    params["image"], patches)
      text = place(common.stream_for(2, streams), _text_tower(heads, wrap),
                   params["text"], tokens)
      return image, text

    def loss(params, patches, tokens):
      image, text = embed(params, patches, tokens)
      logits = params["scale"] * image @ text.T
      labels = jnp.arange(logits.shape[0])
      lse = lambda z: jax.nn.logsumexp(z, axis=-1)
      return 0.5 * jnp.mean(lse(logits) - logits[labels, labels]
                            + lse(logits.T) - logits[labels, labels])

    if size["mode"] == "forward":
      return embed
    return jax.value_and_grad(loss)
  return build


def model(size, streams, key):
  """(make_fn, args): the model written against a placement, and its inputs."""
  params = init(key, size)
  k = jax.random.split(jax.random.fold_in(key, 99))
  patches = common.normal(k[0], (size["batch"], size["patches"], PATCH))
  tokens = jax.random.randint(k[1], (size["batch"], size["tokens"]), 0, VOCAB)
  return make_fn(size, streams), (params, patches, tokens)


def build(size, streams, key):
  fn, args = model(size, streams, key)
  image_layers, text_layers = depths(size)
  layers = (f"{image_layers}" if image_layers == text_layers
            else f"{image_layers}- and {text_layers}")
  return common.standard_case(
      NAME, size, fn, args, streams,
      f"two {layers}-layer scanned towers ({size['mode']}) on "
      f"streams {common.stream_for(1, streams)} and "
      f"{common.stream_for(2, streams)}")
