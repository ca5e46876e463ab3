"""The tower workloads in PyTorch: the anchor a user would reach for instead.

The dual encoder, the GRU bank and the ODE ensemble of this package, and
the flax.linen dual encoder (``linen_dual_encoder``: its parameters read
from flax's tree, its training step with ``torch.optim.AdamW`` set as the
JAX step's optax ``adamw``), on the same weights and inputs, written the way a
PyTorch user runs towers side by side: each tower under ``torch.cuda.stream`` of
a stream of its own, the default stream waiting for all of them before the
towers' results meet (autograd runs each backward op on its forward op's
stream). With ``streams=False`` everything runs on the default stream. Eager
PyTorch, no CUDA graphs: the kernels are launched one by one, as jaxstreams'
loop bodies are.

``build(name, size, args, device, streams)`` returns a function of no
arguments that runs one step and returns a tensor to synchronize on.
``problem()`` says why PyTorch cannot run here (None where it can).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np

NAMES = ("dual_encoder", "gru_bank", "ode_ensemble", "linen_dual_encoder")


def problem(device: str = "cuda") -> str | None:
  try:
    import torch
  except ImportError:
    return "PyTorch is not installed"
  if device == "cuda" and not torch.cuda.is_available():
    return "PyTorch sees no CUDA device"
  return None


def build(name: str, size: dict, args, device: str = "cuda",
          streams: bool = True) -> Callable[[], Any]:
  import torch
  if name == "linen_dual_encoder":   # optax's state: torch keeps its own
    args = (args[0], *args[-2:])
  tensors = _to_torch(args, device)
  lanes = _Lanes(torch, device, streams)
  return {"dual_encoder": _dual_encoder, "gru_bank": _gru_bank,
          "ode_ensemble": _ode_ensemble,
          "linen_dual_encoder": _linen_dual_encoder}[name](
              torch, size, tensors, lanes)


class _Lanes:
  """Where tower k runs: a stream of its own (``streams``), else the
  default stream; ``join()`` makes the default stream wait for them all."""

  def __init__(self, torch, device: str, streams: bool):
    self.torch = torch
    self.on_gpu = device == "cuda"
    self.streams = streams and self.on_gpu
    self._made: list = []

  def tower(self, k: int):
    if not self.streams:
      return contextlib.nullcontext()
    while len(self._made) <= k:
      self._made.append(self.torch.cuda.Stream())
    stream = self._made[k]
    stream.wait_stream(self.torch.cuda.current_stream())
    return self.torch.cuda.stream(stream)

  def join(self) -> None:
    if self.streams:
      for stream in self._made:
        self.torch.cuda.current_stream().wait_stream(stream)


def _to_torch(tree, device: str):
  import torch
  if isinstance(tree, dict):
    return {k: _to_torch(v, device) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return type(tree)(_to_torch(v, device) for v in tree)
  array = np.asarray(tree)
  tensor = torch.as_tensor(array.copy(), device=device)
  return tensor.requires_grad_() if tensor.is_floating_point() else tensor


# ---------------------------------------------------------------------------
# The dual encoder (workloads/dual_encoder.py).

def _norm(torch, x, scale_bias):
  scale, bias = scale_bias
  mean = x.mean(-1, keepdim=True)
  var = ((x - mean) ** 2).mean(-1, keepdim=True)
  return (x - mean) * torch.rsqrt(var + 1e-6) * scale + bias


def _transformer_tower(torch, params, h, heads):
  h = h + params["position"]
  layers = params["layers"]
  for i in range(layers["qkv"].shape[0]):
    b, t, w = h.shape
    q, k, v = (_norm(torch, h, (layers["ln1"][0][i], layers["ln1"][1][i]))
               @ layers["qkv"][i]).split(w, dim=-1)
    split = lambda a: a.reshape(b, t, heads, w // heads).transpose(1, 2)
    scores = split(q) @ split(k).transpose(-1, -2) * (w // heads) ** -0.5
    attn = (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(b, t, w)
    h = h + attn @ layers["out"][i]
    up = (_norm(torch, h, (layers["ln2"][0][i], layers["ln2"][1][i]))
          @ layers["up"][i])
    h = h + torch.nn.functional.gelu(up, approximate="tanh") @ layers["down"][i]
  e = h.mean(1)
  return e / e.norm(dim=-1, keepdim=True)


def _dual_encoder(torch, size, tensors, lanes):
  params, patches, tokens = tensors
  heads = size["heads"]

  def step():
    with lanes.tower(0):
      image = _transformer_tower(torch, params["image"],
                                 patches @ params["image"]["embed"], heads)
    with lanes.tower(1):
      text = _transformer_tower(torch, params["text"],
                                params["text"]["embed"][tokens.long()], heads)
    lanes.join()
    if size["mode"] == "forward":
      with torch.no_grad():
        return image.detach() + 0 * text.detach().sum()
    logits = params["scale"] * image @ text.T
    labels = torch.arange(logits.shape[0], device=logits.device)
    f = torch.nn.functional.cross_entropy
    loss = 0.5 * (f(logits, labels) + f(logits.T, labels))
    for p in _leaves(params):
      p.grad = None
    loss.backward()
    return loss.detach()

  if size["mode"] == "forward":
    return lambda: _no_grad(torch, step)
  return step


# ---------------------------------------------------------------------------
# The flax.linen dual encoder (workloads/linen_dual_encoder.py), on flax's
# parameter tree: DenseGeneral kernels (width, heads, head) and (heads,
# head, width), layers stacked on a leading axis by nn.scan.

def _flax_norm(torch, x, p, i):
  # flax's LayerNorm: the variance as E[x^2] - E[x]^2, at least 0.
  mean = x.mean(-1, keepdim=True)
  var = ((x * x).mean(-1, keepdim=True) - mean * mean).clamp(min=0)
  return (x - mean) * torch.rsqrt(var + 1e-6) * p["scale"][i] + p["bias"][i]


def _linen_tower(torch, p, h):
  h = h + p["position"]
  blocks = p["blocks"]
  attn = blocks["attn"]
  dense = lambda x, d, i: x @ d["kernel"][i] + d["bias"][i]
  for i in range(blocks["up"]["kernel"].shape[0]):
    x = _flax_norm(torch, h, blocks["ln1"], i)
    q, k, v = (torch.einsum("btw,whd->bthd", x, attn[n]["kernel"][i])
               + attn[n]["bias"][i] for n in ("query", "key", "value"))
    q = q / q.shape[-1] ** 0.5
    probs = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(-1)
    o = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    h = h + torch.einsum("bqhd,hdw->bqw", o, attn["out"]["kernel"][i]) \
        + attn["out"]["bias"][i]
    up = torch.nn.functional.gelu(
        dense(_flax_norm(torch, h, blocks["ln2"], i), blocks["up"], i),
        approximate="tanh")
    h = h + dense(up, blocks["down"], i)
  e = h.mean(1)
  return e / e.norm(dim=-1, keepdim=True)


def linen_dual_encoder_embed(torch, params, patches, tokens, lanes):
  """The two towers' embeddings, each tower on its lane."""
  with lanes.tower(0):
    embed = params["patch_embed"]
    image = _linen_tower(torch, params["image"],
                         patches @ embed["kernel"] + embed["bias"])
  with lanes.tower(1):
    text = _linen_tower(torch, params["text"],
                        params["token_embed"]["embedding"][tokens.long()])
  lanes.join()
  return image, text


def _linen_dual_encoder(torch, size, tensors, lanes):
  params, patches, tokens = tensors
  if size["mode"] == "forward":
    return lambda: _no_grad(torch, lambda: torch.cat(linen_dual_encoder_embed(
        torch, params, patches, tokens, lanes)))
  leaves = _leaves(params)
  # optax.adamw(1e-3, weight_decay=1e-4): the same rule (decoupled decay).
  optimizer = torch.optim.AdamW(leaves, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=1e-4)

  def step():
    image, text = linen_dual_encoder_embed(torch, params, patches, tokens,
                                           lanes)
    logits = 10.0 * image @ text.T
    labels = torch.arange(logits.shape[0], device=logits.device)
    f = torch.nn.functional.cross_entropy
    loss = 0.5 * (f(logits, labels) + f(logits.T, labels))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()
  step.params = params
  return step


# ---------------------------------------------------------------------------
# The GRU bank (workloads/gru_bank.py).

def _gru(torch, params, xs):
  hidden = params["wh"].shape[0]
  h = torch.zeros(xs.shape[1], hidden, dtype=xs.dtype, device=xs.device)
  for x in xs:
    gx = x @ params["wx"] + params["b"]
    gh = h @ params["wh"]
    r = torch.sigmoid(gx[:, :hidden] + gh[:, :hidden])
    z = torch.sigmoid(gx[:, hidden:2 * hidden] + gh[:, hidden:2 * hidden])
    n = torch.tanh(gx[:, 2 * hidden:] + r * gh[:, 2 * hidden:])
    h = (1 - z) * n + z * h
  return h


def _gru_bank(torch, size, tensors, lanes):
  models, xs, target = tensors

  def bank():
    outs = []
    for k, m in enumerate(models):
      with lanes.tower(k):
        outs.append(_gru(torch, m, xs))
    lanes.join()
    return torch.stack(outs)

  if size["mode"] == "forward":
    return lambda: _no_grad(torch, bank)

  def step():
    loss = ((bank() - target) ** 2).mean()
    for p in _leaves(models):
      p.grad = None
    loss.backward()
    return loss.detach()
  return step


# ---------------------------------------------------------------------------
# The ODE ensemble (workloads/ode_ensemble.py).

def _solve(torch, params, y, steps):
  def f(y):
    return torch.tanh(y @ params["w1"] + params["b1"]) @ params["w2"]
  dt = 1.0 / steps
  for _ in range(steps):
    k1 = f(y)
    k2 = f(y + 0.5 * dt * k1)
    k3 = f(y + 0.5 * dt * k2)
    k4 = f(y + dt * k3)
    y = y + dt / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
  return y


def _ode_ensemble(torch, size, tensors, lanes):
  members, y0 = tensors

  def ensemble():
    outs = []
    for k, m in enumerate(members):
      with lanes.tower(k):
        outs.append(_solve(torch, m, y0, size["steps"]))
    lanes.join()
    return torch.stack(outs)
  return lambda: _no_grad(torch, ensemble)


def _no_grad(torch, fn):
  with torch.no_grad():
    return fn()


def _leaves(tree):
  if isinstance(tree, dict):
    return [x for v in tree.values() for x in _leaves(v)]
  if isinstance(tree, (list, tuple)):
    return [x for v in tree for x in _leaves(v)]
  return [tree] if getattr(tree, "requires_grad", False) else []
