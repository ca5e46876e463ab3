"""The models of benchmarks/serve.py, each written once for JAX and PyTorch.

A model is ``forward(params, ops, *inputs)``: ``ops`` is ``JaxOps`` or
``TorchOps``, so both frameworks run the same layers on the same weights.
Every request is batch 1. ``MODELS[name](seed)`` gives a ``Model``: its
weights (NumPy), its forward function and a maker of request inputs.

* ``mlp``: 64-256-256-256-16, log-softmax.
* ``encoder``: a small transformer encoder, 32 tokens of width 128, two
  post-norm layers of 4 heads and a 256-wide feed-forward, mean-pooled to
  16 logits.
* ``dlrm``: DLRM-style, 13 dense features through a 13-64-32 bottom MLP,
  8 categorical features each an embedding row (tables of 1000 x 32),
  pairwise dot products of the 9 vectors, a 68-64-1 top MLP, sigmoid.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


class JaxOps:
  def __init__(self):
    import jax
    import jax.numpy as jnp
    self.jax, self.np = jax, jnp

  def relu(self, x):
    return self.jax.nn.relu(x)

  def softmax(self, x, axis):
    return self.jax.nn.softmax(x, axis=axis)

  def log_softmax(self, x, axis):
    return self.jax.nn.log_softmax(x, axis=axis)

  def sigmoid(self, x):
    return self.jax.nn.sigmoid(x)

  def layer_norm(self, x, gain, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / self.np.sqrt(var + eps) * gain + bias

  def swap_last(self, x):
    return self.np.swapaxes(x, -1, -2)

  def take_rows(self, table, index):
    return self.np.take(table, index, axis=0)

  def concat(self, xs, axis):
    return self.np.concatenate(xs, axis=axis)

  def stack(self, xs, axis):
    return self.np.stack(xs, axis=axis)

  def asarray(self, x):
    return self.np.asarray(x)


class TorchOps:
  def __init__(self, device):
    import torch
    self.torch, self.device = torch, device

  def relu(self, x):
    return self.torch.relu(x)

  def softmax(self, x, axis):
    return self.torch.softmax(x, dim=axis)

  def log_softmax(self, x, axis):
    return self.torch.log_softmax(x, dim=axis)

  def sigmoid(self, x):
    return self.torch.sigmoid(x)

  def layer_norm(self, x, gain, bias, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / self.torch.sqrt(var + eps) * gain + bias

  def swap_last(self, x):
    return x.transpose(-1, -2)

  def take_rows(self, table, index):
    return table[index]

  def concat(self, xs, axis):
    return self.torch.cat(xs, dim=axis)

  def stack(self, xs, axis):
    return self.torch.stack(xs, dim=axis)

  def asarray(self, x):
    return self.torch.as_tensor(np.asarray(x), device=self.device)


@dataclasses.dataclass
class Model:
  name: str
  description: str
  params: dict                            # name -> NumPy array (or list)
  forward: Callable                       # forward(params, ops, *inputs)
  inputs: Callable[[int], tuple]          # request i -> NumPy inputs


def _dense(rng, fan_in, fan_out):
  return (rng.standard_normal((fan_in, fan_out), np.float32)
          / np.float32(np.sqrt(fan_in)))


def _mlp_layers(rng, sizes):
  return [(_dense(rng, i, o), np.zeros((o,), np.float32))
          for i, o in zip(sizes[:-1], sizes[1:])]


def _run_mlp(ops, layers, x, last_relu=True):
  for k, (w, b) in enumerate(layers):
    x = x @ w + b
    if last_relu or k < len(layers) - 1:
      x = ops.relu(x)
  return x


def mlp(seed: int = 0) -> Model:
  rng = np.random.default_rng(seed)
  params = {"layers": _mlp_layers(rng, [64, 256, 256, 256]),
            "head": _dense(rng, 256, 16)}

  def forward(p, ops, x):
    return ops.log_softmax(_run_mlp(ops, p["layers"], x) @ p["head"], -1)

  def inputs(i):
    return (np.random.default_rng(1000 + i).standard_normal(
        (1, 64), np.float32),)

  return Model("mlp", "MLP 64-256x3-16", params, forward, inputs)


def encoder(seed: int = 0, tokens=32, width=128, heads=4, layers=2, ff=256,
            classes=16) -> Model:
  rng = np.random.default_rng(seed)
  blocks = []
  for _ in range(layers):
    blocks.append({
        "qkv": _dense(rng, width, 3 * width), "out": _dense(rng, width, width),
        "ff1": _dense(rng, width, ff), "ff2": _dense(rng, ff, width),
        "g1": np.ones((width,), np.float32),
        "b1": np.zeros((width,), np.float32),
        "g2": np.ones((width,), np.float32),
        "b2": np.zeros((width,), np.float32)})
  params = {"blocks": blocks, "head": _dense(rng, width, classes)}
  head_width = width // heads

  def forward(p, ops, x):                 # x: (1, tokens, width)
    for blk in p["blocks"]:
      qkv = x @ blk["qkv"]
      q, k, v = (qkv[..., i * width:(i + 1) * width] for i in range(3))
      outs = []
      for h in range(heads):
        part = slice(h * head_width, (h + 1) * head_width)
        scores = q[..., part] @ ops.swap_last(k[..., part])
        attn = ops.softmax(scores / np.float32(np.sqrt(head_width)), -1)
        outs.append(attn @ v[..., part])
      x = ops.layer_norm(x + ops.concat(outs, -1) @ blk["out"], blk["g1"],
                         blk["b1"])
      x = ops.layer_norm(x + ops.relu(x @ blk["ff1"]) @ blk["ff2"], blk["g2"],
                         blk["b2"])
    return x.mean(1) @ p["head"]

  def inputs(i):
    return (np.random.default_rng(2000 + i).standard_normal(
        (1, tokens, width), np.float32),)

  return Model("encoder", f"transformer encoder, {tokens} tokens x {width}, "
               f"{layers} layers of {heads} heads", params, forward, inputs)


def dlrm(seed: int = 0, dense=13, tables=8, rows=1000, dim=32) -> Model:
  rng = np.random.default_rng(seed)
  params = {"bottom": _mlp_layers(rng, [dense, 64, dim]),
            "tables": [rng.standard_normal((rows, dim), np.float32) * 0.1
                       for _ in range(tables)],
            "top": _mlp_layers(rng, [dim + (tables + 1) * tables // 2, 64, 1])}
  pairs = [(i, j) for i in range(tables + 1) for j in range(i)]

  def forward(p, ops, x, index):          # x: (1, dense); index: (1, tables)
    vectors = [_run_mlp(ops, p["bottom"], x)]
    vectors += [ops.take_rows(t, index[:, k])
                for k, t in enumerate(p["tables"])]
    stacked = ops.stack(vectors, 1)                       # (1, tables+1, dim)
    dots = stacked @ ops.swap_last(stacked)
    flat = ops.concat([dots[:, i, j:j + 1] for i, j in pairs], -1)
    top = _run_mlp(ops, p["top"], ops.concat([vectors[0], flat], -1),
                   last_relu=False)
    return ops.sigmoid(top)

  def inputs(i):
    r = np.random.default_rng(3000 + i)
    return (r.standard_normal((1, dense), np.float32),
            r.integers(0, rows, (1, tables)).astype(np.int32))

  return Model("dlrm", f"DLRM-style, {tables} tables of {rows} x {dim}",
               params, forward, inputs)


MODELS = {"mlp": mlp, "encoder": encoder, "dlrm": dlrm}


def jax_function(model: Model) -> Callable:
  """The model as a JAX function of its inputs, weights closed over (as a
  served model's are)."""
  import jax
  ops = JaxOps()
  params = jax.tree_util.tree_map(ops.asarray, model.params)
  return lambda *inputs: model.forward(params, ops, *inputs)


def torch_function(model: Model, device: str) -> Callable:
  """The model as a PyTorch function of tensors on ``device``."""
  ops = TorchOps(device)

  def convert(value):
    if isinstance(value, (list, tuple)):
      return type(value)(convert(v) for v in value)
    if isinstance(value, dict):
      return {k: convert(v) for k, v in value.items()}
    return ops.asarray(value)

  params = convert(model.params)
  return lambda *inputs: model.forward(params, ops, *inputs)
