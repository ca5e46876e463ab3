"""What each launch of a compiled program does: its flops and bytes.

Read off the compiled HLO's shapes, one figure per instruction that
launches work (a fusion, a library call, a copy): XLA's own cost analysis
gives only the whole program's totals through jax, so the same rules are
applied per instruction here:

* a dot: 2 x its result's elements x the product of its contracting
  dimensions; a convolution (an HLO ``convolution`` or cuDNN's custom
  call): 2 x its result's elements x its kernel's elements per output
  feature; a cuBLAS GEMM: as a dot, from its ``dot_dimension_numbers``;
  the dots of a fusion summed;
* bytes: the result written and every operand read, where an operand that a
  fusion only slices (a scan's layer out of the stacked weights, rows of an
  embedding table) counts as the slices read, not the whole array.

Each launch's flops also carry the number format the tensor cores run them
in (``Work.precision``): bf16 and f16 as such, f8 as fp8, and f32 under
jax's default precision as TF32, which is what XLA uses for an f32 dot on
Ampere and Hopper unless the dot asks for ``HIGHEST``
(``jax.default_matmul_precision``); elementwise work is counted in bytes
only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Mapping, Sequence

from jaxstreams.xla.schedule import Instruction

# Bytes per element of each XLA primitive type.
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
          "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
          "token": 0}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([^\]]*)\]")
_SLICING = frozenset({"slice", "dynamic-slice", "gather"})
_PASS_THROUGH = frozenset({"bitcast", "reshape"})
# Instructions that write part of their first operand's buffer in place:
# what they write is their last operand (the update), not their result.
_IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})
_CONV_TARGETS = ("__cudnn$conv",)
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")


@dataclasses.dataclass(frozen=True)
class Work:
  """What one launch does: floating-point operations on the tensor cores
  (``precision``: the number format they run in, None for none) and bytes
  moved to and from device memory."""
  flops: float = 0.0
  bytes: float = 0.0
  precision: str | None = None


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """The arrays of an HLO shape (one, or a tuple's): (type, dimensions)."""
  found = []
  for dtype, dims in _ARRAY.findall(shape):
    if dtype not in _BYTES and not dtype.startswith("f8"):
      continue
    sizes = tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
    found.append((dtype, sizes))
  return found


def size_in_bytes(shape: str) -> float:
  return sum(math.prod(dims) * _BYTES.get(dtype, 1)
             for dtype, dims in arrays(shape))


def _elements(shape: str) -> int:
  found = arrays(shape)
  return math.prod(found[0][1]) if found else 0


def _dims(shape: str) -> tuple[int, ...]:
  found = arrays(shape)
  return found[0][1] if found else ()


def _dtype(shape: str) -> str:
  found = arrays(shape)
  return found[0][0] if found else ""


def _ints(attributes: str, key: str) -> tuple[int, ...]:
  match = re.search(rf"\b{key}=\{{([\d,]*)\}}", attributes)
  return tuple(int(x) for x in match.group(1).split(",") if x) if match else ()


def _precision(operand_type: str, attributes: str) -> str:
  if operand_type in ("bf16", "f16"):
    return "bf16"
  if operand_type.startswith("f8"):
    return "fp8"
  if operand_type in ("s8", "u8"):
    return "int8"
  if operand_type == "f64":
    return "f64"
  if "highest" in attributes or "dot_f32_f32_f32" in attributes:
    return "f32"
  return "tf32"


class _Shapes:
  """Shapes of a module's instructions by name (XLA names are unique in a
  module)."""

  def __init__(self, computations: Mapping[str, Sequence[Instruction]]):
    self.computations = computations
    self.by_name = {ins.name: ins for body in computations.values()
                    for ins in body}

  def shape(self, name: str) -> str:
    ins = self.by_name.get(name)
    return ins.shape if ins is not None else ""


def _dot_flops(ins: Instruction, shapes: _Shapes) -> tuple[float, str]:
  lhs = shapes.shape(ins.operands[0]) if ins.operands else ""
  dims = _dims(lhs)
  contracted = math.prod(
      dims[d] for d in _ints(ins.attributes, "lhs_contracting_dims")
      if d < len(dims))
  return (2.0 * _elements(ins.shape) * contracted,
          _precision(_dtype(lhs), ins.attributes))


def _conv_flops(ins: Instruction, shapes: _Shapes) -> tuple[float, str]:
  """2 x result elements x the kernel's elements per output feature (HLO's
  convolution: the kernel's input features are already per group)."""
  if len(ins.operands) < 2:
    return 0.0, ""
  kernel = shapes.shape(ins.operands[1])
  dims = _dims(kernel)
  labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attributes)
  per_output = math.prod(dims)
  if labels and "o" in labels.group(1) and len(labels.group(1)) == len(dims):
    per_output //= max(1, dims[labels.group(1).index("o")])
  out = arrays(ins.shape)
  elements = math.prod(out[0][1]) if out else 0
  return (2.0 * elements * per_output,
          _precision(_dtype(shapes.shape(ins.operands[0])), ins.attributes))


def _gemm_flops(ins: Instruction, shapes: _Shapes) -> tuple[float, str]:
  lhs = shapes.shape(ins.operands[0]) if ins.operands else ""
  dims = _dims(lhs)
  config = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]',
                     ins.attributes)
  contracting = ([int(x) for x in json.loads("[" + config.group(1) + "]")]
                 if config else [len(dims) - 1] if dims else [])
  contracted = math.prod(dims[d] for d in contracting if d < len(dims))
  out = arrays(ins.shape)
  elements = math.prod(out[0][1]) if out else 0
  return 2.0 * elements * contracted, _precision(_dtype(lhs), ins.attributes)


def _flops(ins: Instruction, shapes: _Shapes,
           depth: int = 0) -> tuple[float, str | None]:
  """Tensor-core flops of ``ins`` (the dots and convolutions of a fusion
  or a called computation summed), and their number format."""
  if ins.opcode == "dot":
    return _dot_flops(ins, shapes)
  if ins.opcode == "convolution":
    return _conv_flops(ins, shapes)
  if ins.opcode == "custom-call":
    target = re.search(r'custom_call_target="([^"]*)"', ins.attributes)
    name = target.group(1) if target else ""
    if name.startswith(_CONV_TARGETS):
      return _conv_flops(ins, shapes)
    if name.startswith(_GEMM_TARGETS):
      return _gemm_flops(ins, shapes)
    return 0.0, None
  called = ins.called
  if ins.opcode == "fusion" and called and depth < 8:
    total, precision = 0.0, None
    for inner in shapes.computations.get(called, ()):
      flops, kind = _flops(inner, shapes, depth + 1)
      if flops:
        total += flops
        precision = precision or kind
    return total, precision
  return 0.0, None


def _bytes_read(ins: Instruction, shapes: _Shapes) -> float:
  """Bytes ``ins`` reads: each operand's size, or, for an operand a fusion
  only slices, what its slices read."""
  inner = (shapes.computations.get(ins.called, ())
           if ins.opcode == "fusion" and ins.called else ())
  parameters = {}
  for p in inner:
    if p.opcode == "parameter":
      number = p.operand_text.strip()
      if number.isdigit():
        parameters[int(number)] = p.name
  users: dict[str, list[Instruction]] = {}
  for p in inner:
    for operand in p.operands:
      users.setdefault(operand, []).append(p)
  total = 0.0
  for k, operand in enumerate(ins.operands):
    full = size_in_bytes(shapes.shape(operand))
    parameter = parameters.get(k)
    if parameter is not None:
      sliced = _sliced_bytes(parameter, users)
      if sliced is not None:
        full = min(full, sliced)
    total += full
  return total


def _sliced_bytes(name: str, users, depth: int = 0) -> float | None:
  """What the slices of ``name`` read, where every use of it is a slice
  (through bitcasts and reshapes); None where some use reads it whole."""
  found = users.get(name, ())
  if not found or depth > 8:
    return None
  total = 0.0
  for user in found:
    if user.opcode in _SLICING and user.operands and user.operands[0] == name:
      total += size_in_bytes(user.shape)
    elif (user.opcode in _IN_PLACE and user.operands
          and user.operands[0] == name):
      continue                           # updated in place: not read
    elif user.opcode in _SLICING:        # used as an index
      continue
    elif user.opcode in _PASS_THROUGH:
      inner = _sliced_bytes(user.name, users, depth + 1)
      if inner is None:
        return None
      total += inner
    else:
      return None
  return total


# Instructions that launch nothing themselves.
_NO_WORK = frozenset({"parameter", "constant", "get-tuple-element", "tuple",
                      "bitcast", "call-start", "call-done", "async-start",
                      "async-done", "async-update", "opt-barrier", "after-all",
                      "while", "conditional", "call"})


def instruction_work(computations: Mapping[str, Sequence[Instruction]]
                     ) -> dict[str, Work]:
  """Per instruction that launches work (fusions, library calls, copies and
  the like, in any computation), its ``Work``."""
  shapes = _Shapes(computations)
  fused = {ins.called for body in computations.values() for ins in body
           if ins.opcode == "fusion" and ins.called}
  work: dict[str, Work] = {}
  for name, body in computations.items():
    if name in fused:
      continue
    for ins in body:
      if ins.opcode in _NO_WORK:
        continue
      flops, precision = _flops(ins, shapes)
      written = _bytes_written(ins, shapes, flops)
      work[ins.name] = Work(flops, _bytes_read(ins, shapes) + written,
                            precision if flops else None)
  return work


def _bytes_written(ins: Instruction, shapes: _Shapes, flops: float) -> float:
  """The result's bytes; for a fusion that updates part of a buffer in
  place (a scan writing its step's row of the stacked outputs, a scatter
  adding rows to a table), the update's; for a library call, its result
  without its scratch space."""
  if ins.opcode == "custom-call" and flops and len(arrays(ins.shape)) > 1:
    return size_in_bytes(_first(ins.shape))
  if ins.opcode == "fusion" and ins.called:
    body = shapes.computations.get(ins.called, ())
    roots = [i for i in body if i.root]
    if roots:
      root = roots[0]
      parts = ([shapes.by_name.get(o) for o in root.operands]
               if root.opcode == "tuple" else [root])
      if parts and all(p is not None and p.opcode in _IN_PLACE
                       and len(p.operands) > 1 for p in parts):
        return sum(size_in_bytes(shapes.shape(_update(p))) for p in parts)
  return size_in_bytes(ins.shape)


def _update(ins: Instruction) -> str:
  """What an in-place update writes: a dynamic-update-slice's second
  operand, a scatter's last."""
  return (ins.operands[1] if ins.opcode == "dynamic-update-slice"
          else ins.operands[-1])


def _first(shape: str) -> str:
  match = _ARRAY.search(shape)
  return match.group(0) if match else ""
