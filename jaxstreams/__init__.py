"""jaxstreams: plan independent parts of a jitted JAX step onto several streams.

    @jaxstreams.jit(streams=2)
    def step(x, w):
      with jaxstreams.stream(1):
        a = tower_a(x, w)
      b = tower_b(x, w)
      return a + b

The pipeline, one subpackage each: ``tag`` (``stream()`` blocks mark
equations), ``assign`` (each equation gets a stream), ``partition`` (regions
and the ``StreamPlan``), ``lower`` (how the plan runs on a GPU: XLA's
concurrent CUDA graphs, stream calls, or the fastest way timed at the first
call; ``jaxstreams.lower.gpu``), ``runtime`` (the native FFI library) and
``xla`` (what XLA:GPU compiles and launches, seen without a GPU).
"""

from jaxstreams import _compat, config

# The CUDA plugin without a GPU (installed to compile for one): jax on CPU
# at once, without the plugin's tracebacks.
_compat.quiet_cuda_plugin_without_gpu()
from jaxstreams._performance import PerformanceWarning
from jaxstreams.assign import RulesFileError, StreamIdError
from jaxstreams._jit import StreamJit, jit, plan
from jaxstreams._adapters import filter_jit, nnx_jit
from jaxstreams.lower.limits import LoweringError
from jaxstreams.partition import Dependency, PlannedEquation, Region, StreamPlan
from jaxstreams.serving import QueueFullError, Server, ServerClosedError, serve
from jaxstreams.runtime.profile import profile
from jaxstreams.tag import colocate_with, stream
from jaxstreams.staging import prefetch, stage, staged
from jaxstreams.xla import (GpuTargetError, GraphLogError, HloParseError,
                            gpu_target, xla_graphs, xla_schedule)

__version__ = "0.1.0"

__all__ = ["Dependency", "LoweringError", "PlannedEquation", "Region",
           "RulesFileError",
           "StreamIdError",
           "StreamJit", "StreamPlan", "colocate_with", "config", "filter_jit",
           "jit", "nnx_jit", "plan",
           "profile", "stream"]
__all__ += ["QueueFullError", "Server", "ServerClosedError", "serve"]
__all__ += ["PerformanceWarning", "prefetch", "stage", "staged"]
__all__ += ["GpuTargetError", "GraphLogError", "HloParseError", "gpu_target",
            "xla_graphs", "xla_schedule"]
