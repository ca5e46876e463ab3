"""How a plan of several streams runs on a GPU: the ways, and which one when.

A *way* is a program and how XLA turns it into CUDA graphs:

==================== ============================== ============================
way                  program                        compiler options (top level)
==================== ============================== ============================
``inline``           the one ``jax.jit`` builds     none
``concurrent``       the one ``jax.jit`` builds     CONCURRENT graphs
``streams``          each off-main region a call    none (jax >= 0.12: XLA's
                     on its CUDA stream              limit of regions in flight
                                                     raised to the plan's streams)
``streams_concurrent`` stream calls                 CONCURRENT graphs
==================== ============================== ============================

What decides, read off the graphs XLA builds (``jaxstreams.xla_graphs``,
deviceless H100 compiles of the demo step, four branches and DLRM-style
towers) and one H100 run (jax 0.11.2):

* XLA launches a step as CUDA graphs. In jaxlib 0.10 and 0.11 its default
  graph builder chains every command after the previous one: stream calls
  are one sequence there, and they cost fusions across region
  boundaries. From jaxlib 0.12 the graph forks at each stream call and
  joins at its first reader (up to two regions in flight unless raised).
* ``CONCURRENT`` (``xla_gpu_command_buffer_scheduling_mode``) draws the
  graph's edges from data on every version, for ``jax.jit``'s program and
  for stream calls alike, and measured the fastest on the H100 (the
  figures: docs/xla.md). jax takes compiler options only where the
  executable is compiled: a call at top level, not a function traced
  inside another jit.
* So, by default: at top level, ``concurrent``; inside another trace,
  ``streams`` from jax 0.12 (parallel branches under XLA's defaults) and
  ``inline`` before (a chain that costs fusions buys nothing; taking the
  regions out of the graph with a custom call that XLA cannot capture
  runs them on their streams, but launches their kernels one by one,
  which measured slower than ``jax.jit`` on the H100 with command buffers
  off). On a GPU, the first top-level calls time the
  ``candidates`` and keep the fastest (``jaxstreams.lower.autotune``).

On CPU every way is the program ``jax.jit`` builds: XLA:CPU has one stream
and ignores the GPU options.
"""

from __future__ import annotations

import dataclasses

from jaxstreams import _compat

CONCURRENT_GRAPHS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
# XLA's own limit of stream regions in flight (2 by default), read from
# jaxlib 0.12; earlier XLA does not schedule stream calls.
_IN_FLIGHT_LIMIT = "xla_gpu_experimental_parallel_async_compute_limit"
_XLA_DEFAULT_IN_FLIGHT = 2

DEFAULT = "default"


@dataclasses.dataclass(frozen=True)
class Way:
  """One way to run a plan on a GPU."""
  name: str
  program: str          # what emit builds: "inline" or "streams"
  concurrent: bool      # CONCURRENT graphs (a top-level compiler option)
  nested_name: str      # the way used inside another trace
  summary: str

  def compiler_options(self, streams: int) -> dict[str, str]:
    """The compiler options of a top-level call of a plan with ``streams``."""
    options = dict(CONCURRENT_GRAPHS) if self.concurrent else {}
    if (self.program == "streams" and _compat.XLA_SCHEDULES_STREAM_CALLS
        and streams - 1 > _XLA_DEFAULT_IN_FLIGHT):
      options[_IN_FLIGHT_LIMIT] = str(streams - 1)
    return options

  @property
  def nested(self) -> "Way":
    return WAYS[self.nested_name]


WAYS = {way.name: way for way in (
    Way("inline", "inline", False, "inline",
        "the program jax.jit builds"),
    Way("concurrent", "inline", True, "inline",
        "the program jax.jit builds, its CUDA graphs' edges drawn from data "
        "(XLA's CONCURRENT mode)"),
    Way("streams", "streams", False, "streams",
        "each off-main region a call on its own CUDA stream"),
    Way("streams_concurrent", "streams", True, "streams",
        "stream calls, the CUDA graphs' edges drawn from data (XLA's "
        "CONCURRENT mode)"),
)}

NAMES = (DEFAULT, *WAYS)


def default_top_level() -> Way:
  """The way a top-level call runs when nothing was timed."""
  return WAYS["concurrent"]


def default_nested() -> Way:
  """The way a function traced inside another jit runs (no compiler options
  reach it there)."""
  return WAYS["streams" if _compat.XLA_SCHEDULES_STREAM_CALLS else "inline"]


def candidates(plan=None) -> tuple[Way, ...]:
  """The ways the first top-level calls on a GPU time for ``plan`` (the
  function's ``StreamPlan``), ``inline`` (the program ``jax.jit`` builds)
  always among them. Before jax 0.12, where the
  graph of stream calls is one chain, only ``inline`` and ``concurrent``:
  stream calls under XLA's defaults lose there, and with CONCURRENT graphs
  they never ran faster than ``concurrent`` in steady state on an H100,
  though a first call's timing could pick them (docs/xla.md)."""
  if not _compat.XLA_SCHEDULES_STREAM_CALLS:
    return (WAYS["inline"], WAYS["concurrent"])
  return tuple(WAYS[n] for n in ("inline", "concurrent", "streams",
                                 "streams_concurrent"))


def why_default_nested() -> str:
  if _compat.XLA_SCHEDULES_STREAM_CALLS:
    return ("inside another jit: 'streams' (this XLA forks its CUDA graph at "
            "each stream call)")
  return ("inside another jit: 'inline' (this XLA chains stream calls into "
          "one sequence in its CUDA graph, and no compiler option reaches a "
          "function traced inside another jit)")
