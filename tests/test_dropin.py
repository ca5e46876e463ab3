"""jaxstreams.jit as a drop-in for jax.jit (issue 16): each behaviour is
checked side by side with jax.jit in the same test."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from programs import assert_bitwise_equal, cuda_text, random_inputs


def off_main_region(c):
  """The issue's program: a region on stream 1 whose output feeds a product
  of two primals on the main stream."""
  with jaxstreams.stream(1):
    b = jnp.sum(jnp.sin(c))
  return jnp.sin(c * b)


def untagged_towers(x, w1, w2):
  """Independent work with no stream() block: auto=True splits it."""
  a = jnp.tanh(x @ w1) @ w1
  b = jax.nn.relu(x @ w2) @ w2
  return (a * b).sum() * jnp.cos(x).sum()


def _loss_of(f):
  return lambda *a: jax.checkpoint(f)(*a).sum()


def test_grad_of_checkpoint_with_an_off_main_region():
  c = jnp.linspace(0.1, 1.0, 4)
  ours = jaxstreams.jit(off_main_region, streams=2)
  theirs = jax.jit(off_main_region)
  assert_bitwise_equal(jax.grad(_loss_of(ours))(c), jax.grad(_loss_of(theirs))(c))
  assert_bitwise_equal(jax.jit(jax.grad(_loss_of(ours)))(c),
                       jax.jit(jax.grad(_loss_of(theirs)))(c))
  # The regions are still annotated calls in the GPU program, the gradient's
  # included.
  text = cuda_text(jax.jit(jax.grad(_loss_of(ours))), c)
  assert text.count('_xla_stream_annotation = "1"') >= 2
  assert 'inlineable = "false"' in text


def test_grad_of_checkpoint_with_auto_placement():
  x, w1, w2 = random_inputs((8, 16), (16, 16), (16, 16))
  ours = jaxstreams.jit(untagged_towers, streams=3, auto=True)
  assert any(r.stream != 0 for r in ours.plan(x, w1, w2).regions), \
      "auto should split this program, or the test checks nothing"
  theirs = jax.jit(untagged_towers)
  assert_bitwise_equal(
      jax.jit(jax.grad(_loss_of(ours), (1, 2)))(x, w1, w2),
      jax.jit(jax.grad(_loss_of(theirs), (1, 2)))(x, w1, w2))
  # x's cotangent sums the two towers' contributions, and the plan emits the
  # towers in another order than the source: equal to rounding, as without
  # jax.checkpoint (a README sharp edge).
  np.testing.assert_allclose(jax.jit(jax.grad(_loss_of(ours)))(x, w1, w2),
                             jax.jit(jax.grad(_loss_of(theirs)))(x, w1, w2),
                             rtol=1e-5)


@pytest.mark.parametrize("auto", [False, True])
def test_vmap_linearize_and_scan_over_planned_functions(auto):
  c = jnp.linspace(0.1, 1.0, 4)
  ours = jaxstreams.jit(off_main_region, streams=2, auto=auto)
  theirs = jax.jit(off_main_region)
  cs = jnp.stack([c, c * 2, c + 1])
  assert_bitwise_equal(jax.jit(jax.vmap(ours))(cs), jax.jit(jax.vmap(theirs))(cs))
  assert_bitwise_equal(jax.jit(jax.vmap(jax.grad(_loss_of(ours))))(cs),
                       jax.jit(jax.vmap(jax.grad(_loss_of(theirs))))(cs))

  def linearized(f):
    return jax.jit(lambda c, t: jax.linearize(jax.checkpoint(f), c)[1](t))
  assert_bitwise_equal(linearized(ours)(c, c * 3), linearized(theirs)(c, c * 3))

  def scanned(f):
    def loss(c):
      def body(carry, _):
        return jax.checkpoint(f)(carry), carry.sum()
      final, sums = jax.lax.scan(body, c, None, length=3)
      return final.sum() + sums.sum()
    return jax.jit(jax.grad(loss))
  assert_bitwise_equal(scanned(ours)(c), scanned(theirs)(c))


def test_importing_jaxstreams_changes_no_jax_rule():
  """The region rules are installed by the first region emitted, not as a
  side effect of ``import jaxstreams`` (nor by a program without regions)."""
  code = (
      "import jax, jaxstreams\n"
      "from jaxstreams import _compat\n"
      "assert not _compat._region_rules_installed\n"
      "jaxstreams.jit(lambda x: x * 2, streams=2)(1.0)\n"
      "assert not _compat._region_rules_installed\n"
      "def f(x):\n"
      "  with jaxstreams.stream(1):\n"
      "    y = x * 2\n"
      "  return y + 1\n"
      "assert jaxstreams.jit(f, streams=2)(1.0) == 3.0\n"
      "assert _compat._region_rules_installed\n"
      "print('ok')\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "ok"
