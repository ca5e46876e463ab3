"""The argument signature serve and staged key their traces by: shape, dtype,
weak type and the sharding a trace sees."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstreams._signature import leaf_signature, signature, traced_signature


def test_weak_type_and_dtype_tell_scalars_apart():
  python_float, numpy_float = signature([1.0, np.float32(1.0)])
  assert python_float.weak_type and not numpy_float.weak_type
  assert python_float != numpy_float
  assert leaf_signature(jnp.ones((2, 3))) == leaf_signature(np.ones((2, 3),
                                                                    np.float32))


def test_placement_alone_does_not_change_the_signature():
  """Committed or not, an array on one device traces the same program;
  jax.jit compiles for its placement itself."""
  uncommitted = jnp.arange(4.0)
  committed = jax.device_put(np.arange(4.0, dtype=np.float32), jax.devices()[0])
  assert committed.committed and not uncommitted.committed
  assert leaf_signature(committed) == leaf_signature(uncommitted)


def test_traced_signature_equals_the_concrete_one():
  leaves = [jnp.ones(3), 2.0, np.int32(4), jnp.zeros((2, 2), jnp.bfloat16)]
  seen = []

  def f(*args):
    seen.append(traced_signature(args))
    return args

  jax.jit(f)(*leaves)
  assert seen == [signature(leaves)]


def test_struct_traces_as_the_leaf_does():
  for leaf in (1.0, np.float32(1.0), jnp.ones((2,), jnp.bfloat16)):
    f = lambda x: x * 1.5
    assert (jax.make_jaxpr(f)(leaf_signature(leaf).struct()).out_avals
            == jax.make_jaxpr(f)(leaf).out_avals)


def test_tracers_are_refused_by_name():
  def f(x):
    leaf_signature(x)

  with pytest.raises(TypeError, match="traced value"):
    jax.jit(f)(1.0)


SHARDED_PROGRAM = """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jaxstreams
    from jaxstreams._signature import leaf_signature

    assert len(jax.devices()) == 2, jax.devices()
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
    x = np.arange(8, dtype=np.float32)
    split = jax.device_put(x, NamedSharding(mesh, P("x")))
    whole = jax.device_put(x, NamedSharding(mesh, P()))
    on_0 = jax.device_put(x, jax.devices()[0])
    on_1 = jax.device_put(x, jax.devices()[1])

    # The sharding a trace sees is in the key; the devices alone are not.
    assert leaf_signature(split) != leaf_signature(whole)
    assert leaf_signature(split) == leaf_signature(
        jax.device_put(x + 1, NamedSharding(mesh, P("x"))))
    assert leaf_signature(on_0) == leaf_signature(on_1)

    def f(a):
      return a[:, None] * jnp.ones((1, 3), a.dtype)

    expected = {name: jax.jit(f)(arg) for name, arg in
                (("split", split), ("whole", whole))}
    with jaxstreams.serve(f, groups=2, mode="grouped") as server:
      for name, arg in (("split", split), ("whole", whole), ("split", split)):
        out = server(arg)
        assert jax.typeof(out) == jax.typeof(expected[name]), name
        np.testing.assert_array_equal(out, expected[name])
      assert server.stats().signatures_traced == 2   # one per sharding

    def step(scale, batch):
      return jaxstreams.stage(f(batch)) * scale

    batches = [whole, split, whole, split]
    for mode in ("fused", "plain"):
      runner = jaxstreams.staged(step, iter(batches), mode=mode)
      for batch in batches:
        out = runner(np.float32(2))
        reference = jax.jit(step)(np.float32(2), batch)
        assert jax.typeof(out) == jax.typeof(reference), mode
        np.testing.assert_array_equal(out, reference)
      runner.close()
    print("ok")
"""


def test_shardings_on_a_mesh_key_serve_and_staged_apart():
  """On two CPU devices (a fresh process: the device count is fixed when jax
  starts), arrays sharded differently on an explicit mesh have different
  signatures: serve traces once per sharding, and serve's and staged's
  results keep jax.jit's types and values."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=2").strip())
  proc = subprocess.run([sys.executable, "-c",
                         textwrap.dedent(SHARDED_PROGRAM)],
                        capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
      proc.stdout[-2000:] + proc.stderr[-4000:])
