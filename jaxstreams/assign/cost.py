"""A cost model for equations: FLOPs, bytes moved and an estimated time.

It only needs to rank alternatives, not predict wall time. An equation that
starts a kernel of its own (a matmul, convolution, reduction, gather,
scatter, a loop or call) takes at least ``kernel_s`` on its stream, however
little work it has: at small batch that latency, not arithmetic, is what
streams overlap. Elementwise equations are assumed fused into a neighbour's
kernel and cost only their work. Work is ``max(flops / peak_flops, bytes /
bandwidth)``, and the whole GPU does only so much of it at once, so a
schedule can never beat the total work (``Schedule.makespan`` takes that
bound). A region on another stream adds a launch cost; a cross-stream
dependency adds an event. The defaults describe a data-centre GPU (Hopper
class); what drives decisions are the ratios and the fixed overheads, which
are what make tiny splits not pay.
"""

from __future__ import annotations

import dataclasses
import math

from jaxstreams.tag.read import sub_jaxprs


@dataclasses.dataclass(frozen=True)
class DeviceModel:
  peak_flops: float = 50e12        # dense fp32-ish throughput, FLOP/s
  bandwidth: float = 3.0e12        # device memory, bytes/s
  kernel_s: float = 3e-6           # shortest kernel: launch + ramp, per kernel
  region_launch_s: float = 2e-6    # a call on another stream: call-start/done
  event_s: float = 1e-6            # one cross-stream event record + wait
  link_bandwidth: float = 450e9    # between devices (NVLink 4), bytes/s a way
  collective_s: float = 10e-6      # shortest collective: setup and sync


DEFAULT_DEVICE = DeviceModel()


@dataclasses.dataclass(frozen=True)
class Cost:
  flops: float
  bytes: float
  kernels: float = 0.0   # kernels of its own (0 for fusable elementwise work)
  link_bytes: float = 0.0   # sent to other devices (collectives)

  def work_seconds(self, device: DeviceModel = DEFAULT_DEVICE) -> float:
    """Time with the whole GPU to itself (a collective's transfer uses the
    links, not the GPU's compute or memory)."""
    return max(self.flops / device.peak_flops, self.bytes / device.bandwidth)

  def seconds(self, device: DeviceModel = DEFAULT_DEVICE) -> float:
    """Time on its stream: the work, but no less than its kernels' latency
    or its transfer between devices."""
    link = (device.collective_s + self.link_bytes / device.link_bandwidth
            if self.link_bytes else 0.0)
    return max(self.work_seconds(device), self.kernels * device.kernel_s, link)

  def __add__(self, other: "Cost") -> "Cost":
    return Cost(self.flops + other.flops, self.bytes + other.bytes,
                self.kernels + other.kernels,
                self.link_bytes + other.link_bytes)


ZERO = Cost(0.0, 0.0)

# The primitives that move data between devices (jax.lax's collectives;
# axis_index and pvary move nothing), and how many times its larger operand
# or result each sends over the links (a ring all-reduce sends it twice).
COLLECTIVES = {
    "psum": 2.0, "psum_invariant": 2.0, "pmax": 2.0, "pmin": 2.0,
    "ppermute": 1.0, "pbroadcast": 1.0, "all_gather": 1.0,
    "all_gather_invariant": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0,
    "ragged_all_to_all": 1.0, "psend": 1.0, "precv": 1.0,
}

# Primitives that only move or reinterpret data: no arithmetic.
_DATA_MOVEMENT = frozenset({
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims",
    "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad",
    "gather", "scatter", "select_n", "convert_element_type", "copy", "copy_p",
    "rev", "iota", "device_put", "bitcast_convert_type",
})
# Transcendentals cost several FLOPs each.
_TRANSCENDENTAL = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos",
    "tan", "atan2", "erf", "erfc", "erf_inv", "lgamma", "digamma", "pow",
    "rsqrt", "sqrt", "cbrt",
})


def _size(aval) -> int:
  return math.prod(getattr(aval, "shape", ()))


def _bytes(aval) -> int:
  itemsize = getattr(getattr(aval, "dtype", None), "itemsize", None)
  if itemsize is None:   # tokens, opaque or extended dtypes
    itemsize = 4
  return _size(aval) * itemsize


def _avals(atoms):
  return [a.aval for a in atoms if hasattr(a, "aval")]


def equation_cost(eqn) -> Cost:
  """FLOPs and bytes of one equation (sub-jaxprs counted per iteration)."""
  name = eqn.primitive.name
  ins, outs = _avals(eqn.invars), _avals(eqn.outvars)
  moved = float(sum(map(_bytes, ins)) + sum(map(_bytes, outs)))
  out_elems = float(sum(map(_size, outs)))
  if name in COLLECTIVES:
    largest = max(map(_bytes, ins + outs), default=0)
    return Cost(0.0, moved, 1.0, COLLECTIVES[name] * largest)
  if name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = ins[0].shape
    contracted = (math.prod(lhs_shape[d] for d in lhs_contract) if lhs_contract
                  else 1)
    return Cost(2.0 * out_elems * contracted, moved, 1.0)
  if name == "conv_general_dilated":
    rhs_shape = ins[1].shape
    spec = eqn.params["dimension_numbers"]
    out_feature_dim = spec.rhs_spec[0] if spec is not None else 0
    per_output = math.prod(rhs_shape) / max(rhs_shape[out_feature_dim], 1)
    return Cost(2.0 * out_elems * per_output, moved, 1.0)
  subs = list(sub_jaxprs(eqn))
  if subs:
    inner = ZERO
    for sub in subs:
      for sub_eqn in sub.eqns:
        inner = inner + equation_cost(sub_eqn)
    repeats = float(eqn.params.get("length", 1) or 1)
    if name == "cond":
      repeats = 1.0 / max(len(subs), 1)   # one branch runs
    return Cost(inner.flops * repeats, max(inner.bytes * repeats, moved),
                max(inner.kernels * repeats, 1.0), inner.link_bytes * repeats)
  if name in ("gather", "scatter", "scatter-add", "scatter_add", "sort"):
    return Cost(0.0, moved, 1.0)
  if name in _DATA_MOVEMENT:
    return Cost(0.0, moved)
  if name.startswith("reduce") or name in ("argmax", "argmin", "cumsum",
                                           "cumprod", "cummax", "cumlogsumexp"):
    return Cost(float(sum(map(_size, ins))), moved, 1.0)
  factor = 8.0 if name in _TRANSCENDENTAL else 1.0
  return Cost(factor * out_elems, moved)
