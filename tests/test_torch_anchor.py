"""The PyTorch anchor of the flax.linen dual encoder
(``benchmarks/workloads/torch_towers.py``) computes what the JAX model does:
on CPU, on the same weights and inputs, its embeddings, its loss and the
parameters after one AdamW step match the JAX step's (optax ``adamw``) to
float32 rounding. So the GPU benchmark compares jaxstreams with PyTorch on
the same model.

PyTorch is not among the test extras (its wheels are large, and CI needs
none of it): without it these tests skip, saying so. Install the CPU wheel
to run them (``pip install torch --index-url .../whl/cpu``).
"""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the "
                            "anchor's check needs its CPU wheel")

import compile_matrix  # noqa: E402,F401 - puts the checkout on sys.path
from benchmarks.workloads import (linen_dual_encoder,  # noqa: E402
                                  torch_towers)

KEY = jax.random.PRNGKey(0)


def _size(mode):
  return dict(linen_dual_encoder.sizes(quick=True)[0], depths=(3, 2),
              mode=mode)


def test_the_anchor_s_embeddings_are_the_linen_model_s():
  size = _size("forward")
  make_fn, args = linen_dual_encoder.model(size, 3, KEY)
  image, text = jax.jit(make_fn(lambda s, f, *a: f(*a)))(*args)
  step = torch_towers.build("linen_dual_encoder", size, args, device="cpu",
                            streams=False)
  np.testing.assert_allclose(step().numpy(), np.concatenate([image, text]),
                             rtol=1e-5, atol=2e-6)


def test_the_anchor_s_training_step_is_the_linen_step():
  size = _size("train")
  make_fn, args = linen_dual_encoder.model(size, 3, KEY)
  loss, params, _ = jax.jit(make_fn(lambda s, f, *a: f(*a)))(*args)
  step = torch_towers.build("linen_dual_encoder", size, args, device="cpu",
                            streams=False)
  np.testing.assert_allclose(step().numpy(), loss, rtol=1e-5)
  after = jax.tree_util.tree_leaves_with_path(params)
  theirs = jax.tree_util.tree_leaves(step.params)
  assert len(after) == len(theirs)
  for (path, mine), t in zip(after, theirs):
    name = jax.tree_util.keystr(path)
    if "['key']['bias']" in name:
      # Softmax ignores a bias added to every key: its gradient is zero but
      # for rounding, which Adam's first step scales up to +-lr either way.
      continue
    np.testing.assert_allclose(t.detach().numpy(), mine, rtol=1e-5,
                               atol=1e-6, err_msg=name)
