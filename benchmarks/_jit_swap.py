"""A pytest plugin (``-p _jit_swap``): ``jax.jit`` in the tests is
``jaxstreams.jit(f, streams=N, spread=True, **kw)``, N from
``JAX_TESTS_SWAP_STREAMS`` (``jax_tests.py --streams``, 4 by default).

Loaded by ``jax_tests.py`` before the test files are imported, so
``jax.jit``, ``from jax import jit`` and ``@jax.jit`` at import all get the
swap. Calls from jax, jaxlib and jaxstreams themselves keep the real
``jax.jit`` (jaxstreams is built on it; jax's helpers are not the tests).
The swap is the same keywords, handed to jaxstreams unchanged: where
jaxstreams cannot take a call the error is the test's to see.
"""

import functools
import os
import sys

import jax

import jaxstreams

_REAL_JIT = jax.jit
_LIBRARIES = ("jax", "jaxlib", "jaxstreams")
STREAMS = int(os.environ.get("JAX_TESTS_SWAP_STREAMS", "4"))


def _called_by_a_library() -> bool:
  name = sys._getframe(2).f_globals.get("__name__") or ""
  return name.split(".", 1)[0] in _LIBRARIES


def jit(fun=None, /, **kwargs):
  if _called_by_a_library():
    return _REAL_JIT(fun, **kwargs) if fun is not None else _REAL_JIT(**kwargs)
  if fun is None:   # @jax.jit(static_argnums=...)
    return functools.partial(jit, **kwargs)
  return jaxstreams.jit(fun, streams=STREAMS, spread=True, **kwargs)


jit.__wrapped__ = _REAL_JIT
jax.jit = jit
