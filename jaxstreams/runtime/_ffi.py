"""JAX primitives for the runtime's FFI targets, lowered per platform.

We use our own primitives rather than ``jax.ffi.ffi_call`` so that each
platform gets its own lowering rule: a program that uses the runtime lowers
for CPU or CUDA only when that platform's library loaded, and otherwise fails
at lowering time with the loader's message instead of a bare "no custom call
target registered" from XLA at compile time.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxstreams.runtime import _loader

_LOWERING_PLATFORMS = ("cpu", "cuda")


@functools.lru_cache(maxsize=None)
def _jitted_bind(
  prim: Primitive, params: tuple[tuple[str, Any], ...]
) -> Callable:
  kwargs = dict(params)
  return jax.jit(lambda *args: prim.bind(*args, **kwargs))


def _eager_impl(prim: Primitive, *args, **params):
  """Runs an op outside jit by compiling it once per attribute set."""
  return _jitted_bind(prim, tuple(sorted(params.items())))(*args)


def _platform_lowering(platform: str, target: str, rule: Callable) -> Callable:
  def lowering(ctx, *args, **params):
    try:
      _loader.require(platform)
    except _loader.RuntimeLibraryError as e:
      raise _loader.RuntimeLibraryError(
        f"{e} (needed to lower the custom call {target!r} for {platform})"
      ) from None
    return rule(ctx, *args, **params)

  return lowering


def define_op(
  name: str,
  target: str,
  abstract_eval: Callable,
  *,
  attrs: tuple[str, ...] = (),
  multiple_results: bool = False,
  has_side_effect: bool = False,
  alias_operands: bool = False,
) -> Primitive:
  """A primitive whose every bind becomes one custom call to `target`.

  The parameters named in `attrs` become the custom call's FFI attributes
  (pass ints; they become int64); other parameters only serve abstract
  evaluation. With `alias_operands`, result i aliases operand i, so a
  pass-through op costs no copy when XLA can donate the operand.
  """
  prim = Primitive(name)
  prim.multiple_results = multiple_results
  prim.def_abstract_eval(abstract_eval)
  prim.def_impl(functools.partial(_eager_impl, prim))

  def rule(ctx, *args, **params):
    kwargs: dict[str, Any] = {"has_side_effect": has_side_effect}
    if alias_operands and args:
      kwargs["operand_output_aliases"] = {i: i for i in range(len(args))}
    attributes = {k: np.int64(params[k]) for k in attrs}
    return jax.ffi.ffi_lowering(target, **kwargs)(ctx, *args, **attributes)

  for platform in _LOWERING_PLATFORMS:
    mlir.register_lowering(
      prim, _platform_lowering(platform, target, rule), platform=platform
    )
  if alias_operands and multiple_results:
    _define_passthrough_rules(prim)
  return prim


def _define_passthrough_rules(prim: Primitive) -> None:
  """A pass-through op (results = operands) under jax.grad and jax.vmap:
  it acts on the primal values, once, and lets tangents and batch
  dimensions through untouched, so a profiled or event-ordered program
  can still be differentiated or batched from outside."""

  def jvp(primals, tangents, **params):
    return prim.bind(*primals, **params), list(tangents)

  def batch(values, dims, **params):
    return prim.bind(*values, **params), dims

  ad.primitive_jvps[prim] = jvp
  batching.primitive_batchers[prim] = batch
