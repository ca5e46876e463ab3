"""The GPU step in time, estimated from what XLA launches.

A compiled program's step is what one host thread launches, in order
(``launches.GpuProgram``), and what the GPU then runs. Each launch costs
the host something to make (a CUDA graph, a kernel launched one by one, a
library call, a stream call's events, a loop step) and the device
something to run (each kernel: a fixed time plus its flops or bytes over
the target's peak compute or memory bandwidth, whichever is longer,
``work.Work``). ``estimate_step`` plays the launches forward:

* the host makes the launches one after another;
* a launch starts on its stream when the host has made it and the stream's
  earlier work is done; a CUDA graph's kernels start when the kernels they
  wait for (the graph's edges) are done, the GPU starting one kernel of a
  graph after another, each dependency adding a latency;
* a stream call's stream first waits for the launching stream's work so
  far (an event); its done makes the launching stream wait for it;
* a loop runs its body once per step (trip count x body); where the host
  waits for the loop's predicate or a conditional's branch index, it waits
  for the device;
* the call itself (jax's dispatch, arguments and results, waiting for the
  result) adds a fixed time per call and per buffer.

The step is then the later of the host's last launch and the device's last
kernel, plus the call. ``StepEstimate`` gives it with the device's critical
path (the same program with launches that cost the host nothing) and the
host's launch time (the sum of its launch costs), and which of the two
bounds the step.

The constants (``LaunchCosts``) are fitted to step times an H100 measured
(``benchmarks/fit_step_time.py``, ``fitted_costs.py``); the device's peaks
come from the target's description (``Device.of``).
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from typing import Mapping, Sequence

from jaxstreams.xla.launches import (_KINDS, Conditional, CudaGraph,
                                     GpuProgram, GraphLaunch, KernelLaunch,
                                     Loop, StreamCall)
from jaxstreams.xla.work import Work

# Tensor-core (and, for f32/f64, CUDA-core) operations per SM per clock,
# dense, by compute capability major version: NVIDIA's A100 and H100
# whitepapers (A100: 312 TFLOPS bf16 = 108 SMs x 1.41 GHz x 2048; H100
# SXM: 989 TFLOPS bf16 = 132 SMs x 1.83 GHz x 4096) and the B200's
# datasheet (148 SMs, 2.25 PFLOPS bf16 dense: 8192).
_PER_SM_PER_CLOCK = {
    8: {"fp8": 2048, "int8": 4096, "bf16": 2048, "tf32": 1024, "f32": 128,
        "f64": 64},
    9: {"fp8": 8192, "int8": 8192, "bf16": 4096, "tf32": 2048, "f32": 256,
        "f64": 128},
    10: {"fp8": 16384, "int8": 16384, "bf16": 8192, "tf32": 4096, "f32": 256,
         "f64": 128},
}


@dataclasses.dataclass(frozen=True)
class Device:
  """A GPU's peaks: operations per second by number format (``flops``) and
  memory bandwidth in bytes per second."""
  name: str
  flops: Mapping[str, float]
  bandwidth: float
  sms: int = 132          # streaming multiprocessors: a kernel of fewer
                          # thread blocks reaches only that share of the peaks
  threads_per_sm: int = 2048

  @classmethod
  def of(cls, name: str, config_text: str) -> "Device":
    """The peaks of a target (``target.target_config``'s text): SMs x clock
    x operations per SM per clock of its compute capability, and its
    memory bandwidth."""
    def number(key):
      match = re.search(rf"\b{key}:\s*([\d.]+)", config_text)
      if match is None:
        raise ValueError(f"the target description of {name!r} has no {key}; "
                         "it is needed to estimate step times")
      return float(match.group(1))
    sms, clock, bandwidth = (number("core_count"), number("clock_rate_ghz"),
                             number("memory_bandwidth"))
    major = int(number("major"))
    rates = _PER_SM_PER_CLOCK.get(major)
    if rates is None:   # CUDA cores only: fpus_per_core FMAs per clock
      fpus = 2 * number("fpus_per_core")
      rates = {k: fpus for k in _PER_SM_PER_CLOCK[9]}
    return cls(name, {k: sms * clock * 1e9 * v for k, v in rates.items()},
               bandwidth, int(sms), int(number("threads_per_core_limit")))

  def reach(self, launch: tuple[int, int] | None) -> float:
    """The share of the SMs a kernel of ``launch`` (thread blocks, threads
    per block) keeps busy, each block on one SM: the share of the peaks it
    can reach. All of them where unknown."""
    if launch is None:
      return 1.0
    return max(1, min(launch[0], self.sms)) / self.sms

  def occupies(self, launch: tuple[int, int] | None) -> float:
    """The share of the GPU's threads a kernel of ``launch`` holds while it
    runs: what kernels running side by side share. All of it where
    unknown."""
    if launch is None:
      return 1.0
    return min(1.0, launch[0] * launch[1] / (self.sms * self.threads_per_sm))


@dataclasses.dataclass(frozen=True)
class LaunchCosts:
  """What launching and running costs, in seconds (fitted:
  ``fitted_costs.py``). Host: ``call`` once per call, ``argument`` per
  argument and ``result`` per result buffer (jax's dispatch, PJRT, the
  results' allocation, waiting for them),
  ``graph`` per CUDA graph launched and ``graph_node`` per kernel in it
  (XLA updates a graph's commands where buffers moved), ``graph_library``
  per cuBLAS or cuDNN call in it (XLA records such a command by running
  the library under stream capture, again where its buffers moved), ``kernel``
  per kernel (or copy) launched one by one, ``library`` per cuBLAS or cuDNN call
  launched one by one, ``stream_call`` per stream call (an event recorded and
  waited for at its start and its done), ``loop_step`` per step of a loop
  outside the graphs, ``host_wait`` per time the host waits for a value of the
  device (a loop's predicate, a branch index).
  Device: ``kernel_time`` the least a kernel takes, ``graph_latency`` from
  a graph's kernel to one that waits for it, ``graph_issue`` from one
  kernel's start to the next of the same graph, ``stream_latency`` from a
  kernel launched one by one to the next on its stream; ``efficiency``:
  the share of the peaks a kernel reaches."""
  call: float
  argument: float
  result: float
  graph: float
  graph_node: float
  graph_library: float
  kernel: float
  library: float
  stream_call: float
  loop_step: float
  host_wait: float
  kernel_time: float
  graph_latency: float
  graph_issue: float
  stream_latency: float
  efficiency: float = 1.0

  HOST = ("graph", "graph_node", "graph_library", "kernel", "library",
          "stream_call",
          "loop_step", "host_wait")

  def without_host(self) -> "LaunchCosts":
    """The same device, launches that cost the host nothing."""
    return dataclasses.replace(self, **{k: 0.0 for k in self.HOST})


@dataclasses.dataclass(frozen=True)
class StepEstimate:
  """A step's estimated time on a GPU, in seconds: ``step`` (call to
  result), ``device`` (the device's critical path, were launches free),
  ``host`` (the host's launch time, the call's own included) and
  ``bound``: ``"device"`` or ``"host"``, the larger of the two."""
  step: float
  device: float
  host: float
  target: str
  notes: tuple[str, ...] = ()

  @property
  def bound(self) -> str:
    return "host" if self.host > self.device else "device"

  def __str__(self) -> str:
    text = (f"GPU step estimate {self.step * 1e6:.0f} us on {self.target}, "
            f"{self.bound}-bound (host: the call and its launches "
            f"{self.host * 1e6:.0f} us; device path "
            f"{self.device * 1e6:.0f} us)")
    return text + "".join(f"; {n}" for n in self.notes)


_LIBRARY = frozenset({"cuBLAS", "cuDNN"})
_STEPS_PLAYED = 3   # loop steps played before the rest are extrapolated


class _Play:
  """The launches played forward: the host's clock, each stream's, and the
  host's total launch cost."""

  def __init__(self, costs: LaunchCosts, device: Device,
               work: Mapping[str, Work]):
    self.costs, self.device, self.work = costs, device, work
    self.host = 0.0
    self.spent = 0.0                    # host launch costs, summed
    self.ready: dict[int, float] = {}   # stream -> when its work is done
    self.notes: set[str] = set()

  def charge(self, seconds: float) -> None:
    self.host += seconds
    self.spent += seconds

  def duration(self, instruction: str | None,
               launch: tuple[int, int] | None) -> float:
    """A kernel's device time: its fixed time plus the longer of its flops
    over the peak of their number format and its bytes over the memory
    bandwidth, both scaled to the share of the SMs its blocks keep busy."""
    work = self.work.get(instruction or "")
    time = self.costs.kernel_time
    if work is None:
      return time
    efficiency = self.costs.efficiency * self.device.reach(launch)
    compute = (work.flops
               / (self.device.flops.get(work.precision, 0) * efficiency)
               if work.flops and self.device.flops.get(work.precision) else 0.0)
    memory = work.bytes / (self.device.bandwidth * efficiency)
    return time + max(compute, memory)

  def stream(self, stream: int) -> float:
    return self.ready.get(stream, 0.0)

  def sequence(self, launches: Sequence, stream: int) -> None:
    joins: dict[int, list[StreamCall]] = {}
    for i, launch in enumerate(launches):
      self.launch(launch, stream)
      if isinstance(launch, StreamCall):
        joins.setdefault(i + launch.window, []).append(launch)
      for call in joins.pop(i, ()):
        self.ready[stream] = max(self.stream(stream), self.stream(call.stream))

  def launch(self, launch, stream: int) -> None:
    costs = self.costs
    if isinstance(launch, KernelLaunch):
      self.charge(costs.library if launch.kind in _LIBRARY else costs.kernel)
      previous = self.ready.get(launch.stream)
      start = (self.host if previous is None else
               max(self.host, previous + costs.stream_latency))
      self.ready[launch.stream] = start + self.duration(launch.instruction,
                                                        launch.launch)
    elif isinstance(launch, GraphLaunch):
      kernels = launch.graph.kernels
      library = sum(_KINDS.get(k.name) in _LIBRARY for k in kernels)
      self.charge(costs.graph + costs.graph_node * len(kernels)
                  + costs.graph_library * library)
      start = max(self.host, self.stream(launch.stream))
      self.ready[launch.stream] = start + self.graph_time(launch)
    elif isinstance(launch, StreamCall):
      self.charge(costs.stream_call)
      own = launch.stream
      self.ready[own] = max(self.stream(own), self.stream(stream), self.host)
      self.sequence(launch.launches, own)
    elif isinstance(launch, Loop):
      self.loop(launch)
    elif isinstance(launch, Conditional):
      self.conditional(launch)

  def loop(self, loop: Loop) -> None:
    steps = loop.trip_count
    if steps is None:
      steps = 1
      self.notes.add("a loop of unknown trip count counted as one step")
    history = []
    for _ in range(min(steps, _STEPS_PLAYED)):
      self.charge(self.costs.loop_step)
      if loop.host_waits:
        self.sequence(loop.condition, loop.stream)
        self.wait_for(loop.stream)
      self.sequence(loop.body, loop.stream)
      history.append((self.host, self.spent, dict(self.ready)))
    if steps > len(history) >= 2:   # the steps left, at the last step's pace
      rest = steps - len(history)
      (h0, s0, r0), (h1, s1, r1) = history[-2], history[-1]
      self.host = h1 + rest * (h1 - h0)
      self.spent = s1 + rest * (s1 - s0)
      self.ready = {k: v + rest * (v - r0.get(k, v)) for k, v in r1.items()}

  def wait_for(self, stream: int) -> None:
    """The host waits for a value the device computes on ``stream``."""
    self.host = max(self.host, self.stream(stream))
    self.charge(self.costs.host_wait)

  def conditional(self, conditional: Conditional) -> None:
    if conditional.host_waits:
      self.wait_for(conditional.stream)
    best = None
    for branch in conditional.branches:   # the slowest branch
      trial = self.copy()
      trial.sequence(branch, conditional.stream)
      end = max([trial.host, *trial.ready.values()])
      if best is None or end > best[0]:
        best = (end, trial)
    if best is not None:
      trial = best[1]
      self.host, self.spent, self.ready = trial.host, trial.spent, trial.ready
      self.notes |= trial.notes
    if len(conditional.branches) > 1:
      self.notes.add("a conditional counted as its slowest branch")

  def copy(self) -> "_Play":
    other = _Play(self.costs, self.device, self.work)
    other.host, other.spent, other.ready = (self.host, self.spent,
                                            dict(self.ready))
    return other

  def graph_time(self, launch: GraphLaunch) -> float:
    """How long a graph runs once started: its kernels started one after
    another by the GPU, each when those it waits for are done and the SMs
    it needs are free (kernels of few threads run side by side; two that
    fill the GPU, one after the other)."""
    graph: CudaGraph = launch.graph
    costs = self.costs
    nested = {getattr(n, "instruction", None): n for n in launch.nested}
    durations, shares = {}, {}
    for k in graph.kernels:
      inner = nested.get(k.instruction) if k.instruction else None
      durations[k.node] = (self.nested_time(inner, launch.stream)
                           if inner is not None else
                           self.duration(k.instruction, k.launch))
      shares[k.node] = (1.0 if inner is not None
                        else self.device.occupies(k.launch))
    waiting = {k.node: len(k.inputs) for k in graph.kernels}
    users: dict[int, list[int]] = {}
    for k in graph.kernels:
      for i in k.inputs:
        users.setdefault(i, []).append(k.node)
    earliest = {k.node: 0.0 for k in graph.kernels}
    ready = [(0.0, k.node) for k in graph.kernels if not k.inputs]
    heapq.heapify(ready)
    issued, end = -costs.graph_issue, 0.0
    running: list[tuple[float, float]] = []   # (finish, share), a heap
    busy = 0.0
    while ready:
      at, node = heapq.heappop(ready)
      start = max(at, issued + costs.graph_issue)
      while running and (running[0][0] <= start
                         or busy + shares[node] > 1.0 + 1e-9):
        finish, share = heapq.heappop(running)
        busy -= share
        start = max(start, finish)
      issued = start
      finish = start + durations[node]
      heapq.heappush(running, (finish, shares[node]))
      busy += shares[node]
      end = max(end, finish)
      for user in users.get(node, ()):
        earliest[user] = max(earliest[user], finish + costs.graph_latency)
        waiting[user] -= 1
        if waiting[user] == 0:
          heapq.heappush(ready, (earliest[user], user))
    return end

  def nested_time(self, launch, stream: int) -> float:
    """Device time of a loop or conditional inside a graph (the GPU runs
    it without the host)."""
    inner = _Play(self.costs.without_host(), self.device, self.work)
    inner.launch(launch, stream)
    self.notes |= inner.notes
    return max(inner.ready.values(), default=0.0)


def estimate_step(program: GpuProgram, costs: LaunchCosts, device: Device,
                  device_path: bool = True) -> StepEstimate:
  """The step time of ``program`` on ``device`` (``device_path=False``:
  the step alone, the device's path left at 0, for a fit that needs only
  that)."""
  launches, work = program.launches, program.work
  full = _Play(costs, device, work)
  full.sequence(launches, 0)
  call = (costs.call + costs.argument * program.arguments
          + costs.result * program.results)
  step = call + max([full.host, *full.ready.values()])
  if device_path:
    free = _Play(costs.without_host(), device, work)
    free.sequence(launches, 0)
    device_path = max(free.ready.values(), default=0.0)
  else:
    device_path = 0.0
  return StepEstimate(step, device_path, call + full.spent, device.name,
                      tuple(sorted(full.notes)))
