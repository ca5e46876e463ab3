"""Bad input gets an error that names the value, the limit and its source."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams


def test_stream_id_out_of_range_names_line_and_limit():
  def f(x):
    with jaxstreams.stream(3):
      return jnp.sin(x)

  with pytest.raises(jaxstreams.StreamIdError) as info:
    jaxstreams.jit(f, streams=2)(jnp.ones(2))
  message = str(info.value)
  assert "jaxstreams.stream(3)" in message
  assert "[0, 2)" in message and "streams=2" in message
  assert "test_errors.py" in message
  assert "jaxstreams.jit(streams=...)" in message


def test_stream_id_out_of_range_from_the_option():
  def f(x):
    with jaxstreams.stream(1):
      return jnp.sin(x)

  with pytest.raises(jaxstreams.StreamIdError,
                     match="jaxstreams_streams option"):
    jaxstreams.jit(f)(jnp.ones(2))


def test_out_of_range_inside_a_loop_body_is_caught_too():
  def f(x):
    def body(c, _):
      with jaxstreams.stream(7):
        return jnp.sin(c), None
    return jax.lax.scan(body, x, None, length=2)[0]

  with pytest.raises(jaxstreams.StreamIdError, match=r"stream\(7\)"):
    jaxstreams.plan(f, streams=2)(jnp.ones(2))


@pytest.mark.parametrize("bad, error, text", [
    (-1, ValueError, "must be >= 0"),
    (1.5, TypeError, "got 1.5 of type float"),
    ("1", TypeError, "of type str"),
    (True, TypeError, "bool"),
    (None, TypeError, "NoneType"),
])
def test_bad_stream_ids(bad, error, text):
  with pytest.raises(error, match=text):
    jaxstreams.stream(bad)


def test_numpy_integer_stream_ids_are_fine():
  assert jaxstreams.stream(np.int64(2)).stream_id == 2


def test_include_grad_must_be_bool():
  with pytest.raises(TypeError, match="include_grad must be a bool"):
    jaxstreams.stream(1, include_grad="yes")


@pytest.mark.parametrize("bad, error, text", [
    (0, ValueError, "must be >= 1"),
    (-2, ValueError, "must be >= 1"),
    (2.0, TypeError, "integer >= 1, got 2.0"),
    (True, TypeError, "bool"),
])
def test_bad_stream_counts(bad, error, text):
  with pytest.raises(error, match=text):
    jaxstreams.jit(lambda x: x, streams=bad)


def test_unknown_jit_keyword():
  with pytest.raises(TypeError, match="static_argnum.*takes streams="):
    jaxstreams.jit(lambda x: x, static_argnum=0)


def test_jax_jit_keyword_errors_surface_at_decoration():
  with pytest.raises(Exception):
    jaxstreams.jit(lambda x: x, static_argnames=3.5)


def test_not_callable():
  """jax.jit's own error (tests/test_dropin.py compares the two)."""
  with pytest.raises(TypeError, match="callable value, got 3"):
    jaxstreams.jit(3)


def test_colocate_with_needs_a_traced_value():
  with pytest.raises(TypeError, match="numpy.ndarray"):
    jaxstreams.colocate_with(np.ones(2))
  with pytest.raises(TypeError, match="traced inside a jaxstreams.jit"):
    jaxstreams.colocate_with(3.0)


def test_failed_trace_leaves_the_function_usable():
  state = {"fail": True}

  def f(x):
    if state["fail"]:
      with jaxstreams.stream(5):
        return jnp.sin(x)
    with jaxstreams.stream(1):
      return jnp.sin(x)

  g = jaxstreams.jit(f, streams=2)
  with pytest.raises(jaxstreams.StreamIdError):
    g(jnp.ones(2))
  state["fail"] = False
  np.testing.assert_array_equal(g(jnp.ones(2)), jnp.sin(jnp.ones(2)))
