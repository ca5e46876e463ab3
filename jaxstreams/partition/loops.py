"""Loops that run side by side: independent scans on different streams,
grouped to run as one loop.

XLA:GPU runs a loop outside its CUDA graphs, kernel by kernel, on the stream
its loop instruction is on, and one host thread walks the program: two
``lax.scan`` towers run one after the other, under ``jax.jit`` and under
CONCURRENT graphs alike. A loop inside a stream call would run on that
call's stream, but XLA cannot compile every loop there (a loop's counter is a
constant, and jaxlib 0.12 crashes on constants inside a stream call; jaxlib
0.11 fails on the asynchronous slices of the stacked layers; docs/xla.md).

So jaxstreams groups them: scans of the same direction, on different
streams, none depending on another, become one loop whose step runs each
scan's body, each on its own stream (a stream call per body, or in place for
the main stream's). The loop itself stays on the main stream, where XLA
compiles it on every version; each step's bodies run side by side and the
host never waits inside it (the trip count is known).

Scans of different lengths share the loop for as long as they all run
(``layout``): where one length divides another, the longer scan's step runs
several of its layers (a dual encoder's 24-layer image tower takes two layers
a step beside a 12-layer text tower); otherwise the longer one's first layers
share the loop and the layers left run after it (before it, for a reverse
loop), grouped again where several scans have some left.

Here the groups are found and laid out; ``partition`` gives each grouped
scan a region of its own and orders the regions so that a group's are
adjacent; lowering emits a group as one loop where the way fuses loops
(``jaxstreams.lower``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

LOOP_PRIMITIVE = "scan"
# The most layers of one scan a step of a group's loop runs: its body is
# emitted that many times over, which XLA compiles that many times.
MAX_LAYERS_PER_STEP = 4


def groupable(eqn) -> bool:
  """Whether ``eqn`` is a scan that can join a group: no side effects (a
  group reorders work), the plain forward or reverse loop ``lax.scan``
  makes, and a loop for XLA (a scan unrolled whole leaves no loop: its
  layers are kernels in the CUDA graph already)."""
  if eqn.primitive.name != LOOP_PRIMITIVE or eqn.effects:
    return False
  params = eqn.params
  length = int(params["length"])
  return (length > 0 and int(params.get("unroll", 1)) < length
          and not params.get("_split_transpose", False))


def loop_key(eqn) -> tuple:
  """What scans in one group share: their direction."""
  return (bool(eqn.params["reverse"]),)


def loop_length(eqn) -> int:
  return int(eqn.params["length"])


@dataclasses.dataclass(frozen=True)
class Phase:
  """One loop of a group: ``steps`` steps, in each of which scan
  ``members[i]`` (its position in the group) runs ``per_step[i]`` of its
  layers, its layers ``starts[i]`` to ``starts[i] + steps * per_step[i]``.
  A phase with one member is that scan's remaining layers, alone."""
  steps: int
  members: tuple[int, ...]
  starts: tuple[int, ...]
  per_step: tuple[int, ...]

  def layers(self, i: int) -> tuple[int, int]:
    """The layers (first, last + 1) of ``members[i]`` in this phase."""
    return self.starts[i], self.starts[i] + self.steps * self.per_step[i]


def layout(lengths: Sequence[int]) -> tuple[Phase, ...]:
  """How scans of ``lengths`` (layers each) run as one loop: the phases in
  the order of their layers, lowest first (a forward loop runs them in this
  order, a reverse loop from the last).

  The first phase has every scan in it. Where the lengths over their
  greatest common divisor are at most ``MAX_LAYERS_PER_STEP`` it covers
  them all (that many steps, each scan taking its share of layers a step).
  Otherwise it has as many steps as the shortest scan has layers, each scan
  taking as many layers a step as fit (at most ``MAX_LAYERS_PER_STEP``),
  and the layers left are laid out again: a later phase groups the scans
  with layers left, one scan alone runs its own loop. Each layer keeps its
  own operations in their order: only which loop step runs it changes."""
  phases: list[Phase] = []
  members = list(range(len(lengths)))
  starts = [0] * len(lengths)
  left = [int(n) for n in lengths]
  while True:
    live = [m for m in members if left[m] > 0]
    if not live:
      return tuple(phases)
    counts = [left[m] for m in live]
    if len(live) == 1:
      steps, per_step = counts[0], [1]
    else:
      common = math.gcd(*counts)
      if max(counts) // common <= MAX_LAYERS_PER_STEP:
        steps, per_step = common, [n // common for n in counts]
      else:
        steps = min(counts)
        per_step = [min(n // steps, MAX_LAYERS_PER_STEP) for n in counts]
    phases.append(Phase(steps, tuple(live), tuple(starts[m] for m in live),
                        tuple(per_step)))
    for m, k in zip(live, per_step):
      starts[m] += steps * k
      left[m] -= steps * k


def find_groups(eqns: Sequence, sources: Sequence[Sequence[int]],
                streams: Sequence[int]) -> list[tuple[int, ...]]:
  """Groups of at least two scan equations (positions in ``eqns``, each
  group in program order) that can run as one loop: the same direction,
  each on a stream of its own (``streams[i]``), and none reading, directly
  or not, what another makes. Grouped greedily in program order, a scan
  joining the first group it fits."""
  loops = [i for i, eqn in enumerate(eqns) if groupable(eqn)]
  if len(loops) < 2:
    return []
  ancestors = _ancestors(sources, upto=max(loops))
  groups: list[list[int]] = []
  keys: list[tuple] = []
  for i in loops:
    key = loop_key(eqns[i])
    for group, group_key in zip(groups, keys):
      if (group_key == key
          and all(streams[j] != streams[i] for j in group)
          and all(not (ancestors[i] >> j) & 1 for j in group)):
        group.append(i)
        break
    else:
      groups.append([i])
      keys.append(key)
  return [tuple(g) for g in groups if len(g) > 1]


def _ancestors(sources, upto: int) -> list[int]:
  """Per equation up to ``upto``, the bitmask of the equations it depends on."""
  masks: list[int] = []
  for i in range(upto + 1):
    mask = 0
    for j in sources[i]:
      mask |= masks[j] | (1 << j)
    masks.append(mask)
  return masks
