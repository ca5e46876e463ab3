"""How a plan of several streams runs on a GPU: the ways, and which one when.

A *way* is a program and how XLA turns it into CUDA graphs:

==================== ============================== ============================
way                  program                        compiler options (top level)
==================== ============================== ============================
``inline``           the one ``jax.jit`` builds     none
``concurrent``       the one ``jax.jit`` builds     CONCURRENT graphs
``loops``            ``jax.jit``'s, with independent none
                     loops run as one, each body on
                     its stream
``loops_concurrent`` the same                       CONCURRENT graphs
``streams``          each off-main region a call    none (jax >= 0.12: XLA's
                     on its CUDA stream, loops as    limit of regions in flight
                     in ``loops``                    raised to the plan's
                                                     streams)
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
* XLA runs a loop outside its CUDA graphs, kernel by kernel on the loop's
  stream: two towers of ``lax.scan`` run one after the other in ``jax.jit``'s
  program, CONCURRENT or not. Where the plan has independent loops on
  different streams, ``loops`` runs them as one loop whose step runs each
  body on its stream (``jaxstreams.lower.loops``; a plan without such loops
  gets ``jax.jit``'s program from it).
* So, by default: at top level, ``concurrent`` (``loops_concurrent`` where
  the plan has loops to run side by side); inside another trace,
  ``streams`` from jax 0.12 (parallel branches under XLA's defaults) and
  ``loops`` before (a chain that costs fusions buys nothing; taking the
  regions out of the graph with a custom call that XLA cannot capture
  runs them on their streams, but launches their kernels one by one,
  which measured slower than ``jax.jit`` on the H100 with command buffers
  off). On a GPU, the first top-level calls time the
  ``candidates`` and keep the fastest (``jaxstreams.choose.choice``).

On CPU every way is the program ``jax.jit`` builds: XLA:CPU has one stream
and ignores the GPU options.
"""

from __future__ import annotations

import dataclasses

from jaxstreams import _compat
from jaxstreams.lower import limits

CONCURRENT_GRAPHS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
# XLA's own limit of stream regions in flight (2 by default), read from
# jaxlib 0.12; earlier XLA does not schedule stream calls.
_IN_FLIGHT_LIMIT = "xla_gpu_experimental_parallel_async_compute_limit"
_XLA_DEFAULT_IN_FLIGHT = 2

DEFAULT = "default"
_GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})


def is_gpu(platform_name: str) -> bool:
  """Whether a device of this platform runs the GPU ways."""
  return platform_name.lower() in _GPU_PLATFORMS


# The command types XLA puts into CUDA graphs (its default list, read from
# XLA's command-buffer log of each jaxlib; tests/test_gpu_view.py checks it
# on every CI run). Setting the option replaces the list, so a type is
# added by giving the default list and it.
COMMAND_BUFFER_TYPES = "xla_gpu_enable_command_buffer"
_DEFAULT_COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL",
                                 "CUDNN", "CONDITIONAL", "DYNAMIC_SLICE_FUSION")
CONVOLUTIONS = frozenset({"conv_general_dilated"})

# XLA makes a CUDA graph of a span of commands only from this many top-level
# thunks on (5 by default in XLA's debug options), and a stream call is two
# (its start and its done): a loop step whose only commands are two bodies'
# calls (4) would stay out of every graph, its kernels launched one by one.
# With CONCURRENT graphs, where such a step is meant to be one graph, the
# programs with calls lower the threshold to that.
MIN_GRAPH_SIZE = "xla_gpu_graph_min_graph_size"
_TWO_CALLS = 4


def xla_command_buffer_types() -> tuple[str, ...]:
  """The installed XLA's default command-buffer types."""
  if _compat.jaxlib_version() >= (0, 12):
    return (*_DEFAULT_COMMAND_BUFFER_TYPES, "COLLECTIVES_KERNEL")
  return _DEFAULT_COMMAND_BUFFER_TYPES


def holds_convolutions(plan) -> bool:
  """Whether a region of ``plan`` (a ``StreamPlan``) has a convolution."""
  return plan is not None and any(r.holds & CONVOLUTIONS for r in plan.regions)


def _makes_calls(plan) -> bool:
  """Whether a program of stream calls or loops run as one makes calls for
  ``plan`` (a ``StreamPlan``; None: not known, so it may)."""
  return plan is None or bool(plan.loops) or any(r.is_call
                                                 for r in plan.regions)


@dataclasses.dataclass(frozen=True)
class Way:
  """One way to run a plan on a GPU."""
  name: str
  program: str          # what emit builds: "inline" or "streams"
  concurrent: bool      # CONCURRENT graphs (a top-level compiler option)
  nested_name: str      # the way used inside another trace
  summary: str

  def compiler_options(self, streams: int, plan=None) -> dict[str, str]:
    """The compiler options of a top-level call of a plan with ``streams``
    (``plan``: its ``StreamPlan``, where known). With CONCURRENT graphs, a
    plan whose regions hold convolutions gets them into the graphs too
    (``CONVOLUTION`` is no default command-buffer type: without it an
    Inception-style step has no graph at all, its kernels launched one by
    one on one stream)."""
    options = dict(CONCURRENT_GRAPHS) if self.concurrent else {}
    if self.concurrent and self.program != "inline" and _makes_calls(plan):
      options[MIN_GRAPH_SIZE] = str(_TWO_CALLS)
    if self.concurrent and holds_convolutions(plan):
      options[COMMAND_BUFFER_TYPES] = ",".join(
          (*xla_command_buffer_types(), "CONVOLUTION"))
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
    Way("loops", "loops", False, "loops",
        "the program jax.jit builds, independent loops run as one loop with "
        "each body on its own CUDA stream"),
    Way("loops_concurrent", "loops_graphed", True, "loops",
        "the program jax.jit builds, independent loops run as one loop with "
        "each body on its own CUDA stream, CUDA graphs' edges drawn from data "
        "(XLA's CONCURRENT mode)"),
    Way("streams", "streams", False, "streams",
        "each off-main region a call on its own CUDA stream"),
    Way("streams_concurrent", "streams", True, "streams",
        "stream calls, the CUDA graphs' edges drawn from data (XLA's "
        "CONCURRENT mode)"),
)}

NAMES = (DEFAULT, *WAYS)


def has_loop_groups(plan) -> bool:
  """Whether ``plan`` (a ``StreamPlan``) has independent loops that the
  ``loops`` program runs as one."""
  return plan is not None and bool(plan.loops)


def default_top_level(plan=None) -> Way:
  """The way a top-level call of ``plan`` runs when nothing was timed:
  ``loops_concurrent`` where the plan has loops to run as one,
  ``concurrent`` where a CUDA graph can hold two of its regions side by
  side, else ``inline``. CONCURRENT graphs cost memory by themselves (XLA
  keeps apart the buffers of kernels that may run at once: same program,
  1.07x to 2.6x its temporaries, docs/xla.md#memory), so they are the default
  only where the plan puts work they can run side by side: not where all
  that can run side by side is loops, which XLA runs outside its graphs."""
  if has_loop_groups(plan):
    return WAYS["loops_concurrent"]
  if plan is None or graphs_can_overlap(plan):
    return WAYS["concurrent"]
  return WAYS["inline"]


def graphs_can_overlap(plan) -> bool:
  """Whether two regions of ``plan`` (a ``StreamPlan``) on different
  streams, neither reaching the other, both do work outside loops (in its
  shard_map bodies too): what a CUDA graph can run side by side."""
  reach = [0] * len(plan.regions)    # bit j of reach[i]: a path i -> j
  for a, b in sorted(plan.edges, reverse=True):   # regions are topological
    reach[a] |= (1 << b) | reach[b]
  graphed = [any(plan.equations[e].primitive not in limits.LOOPS
                 for e in r.equations) for r in plan.regions]
  for i, ri in enumerate(plan.regions):
    for j in range(i + 1, len(plan.regions)):
      if (graphed[i] and graphed[j] and ri.stream != plan.regions[j].stream
          and not (reach[i] >> j) & 1):
        return True
  return any(graphs_can_overlap(body) for body in plan.bodies.values())


def default_nested() -> Way:
  """The way a function traced inside another jit runs (no compiler options
  reach it there; decided before any plan is made, so each program makes
  its own per-plan choices: ``loops`` and ``streams`` run independent loops
  as one, and a plan without them gets jax.jit's program from ``loops``)."""
  return WAYS["streams" if _compat.XLA_SCHEDULES_STREAM_CALLS else "loops"]


def candidates(plan=None) -> tuple[Way, ...]:
  """The ways the first top-level calls on a GPU time for ``plan`` (the
  function's ``StreamPlan``), ``inline`` (the program ``jax.jit`` builds)
  always among them, ``loops_concurrent`` where the plan has loops to run
  side by side. Before jax 0.12, where the graph of stream calls is one
  chain, no stream calls: under XLA's defaults they lose there, and with
  CONCURRENT graphs they never ran faster than ``concurrent`` in steady
  state on an H100, though a first call's timing could pick them
  (docs/xla.md)."""
  names = ["inline", "concurrent"]
  if has_loop_groups(plan):
    names.append("loops_concurrent")
  if _compat.XLA_SCHEDULES_STREAM_CALLS:
    names += ["streams", "streams_concurrent"]
  return tuple(WAYS[n] for n in names)


def why_default_nested(plan=None) -> str:
  """What the default runs inside another jit for ``plan``, and why."""
  if _compat.XLA_SCHEDULES_STREAM_CALLS:
    return ("inside another jit: 'streams' (this XLA forks its CUDA graph at "
            "each stream call)")
  chained = ("this XLA chains stream calls into one sequence in its CUDA "
             "graph, and no compiler option reaches a function traced inside "
             "another jit")
  if has_loop_groups(plan):
    return (f"inside another jit: 'loops' ({chained}; independent loops run "
            "as one loop with each body on its stream, the rest as jax.jit "
            "builds it)")
  return f"inside another jit: 'inline' ({chained})"
