"""Loops that run side by side: independent scans on different streams,
grouped to run as one loop.

XLA:GPU runs a loop outside its CUDA graphs, kernel by kernel, on the stream
its loop instruction is on, and one host thread walks the program: two
``lax.scan`` towers run one after the other, under ``jax.jit`` and under
CONCURRENT graphs alike. A loop inside a stream call would run on that
call's stream, but XLA cannot compile every loop there (a loop's counter is a
constant, and jaxlib 0.12 crashes on constants inside a stream call; jaxlib
0.11 fails on the asynchronous slices of the stacked layers; docs/xla.md).

So jaxstreams groups them: scans of the same length and direction, on
different streams, none depending on another, become one loop whose step
runs each scan's body, each on its own stream (a stream call per body, or in
place for the main stream's). The loop itself stays on the main stream,
where XLA compiles it on every version; each step's bodies run side by side
and the host never waits inside it (the trip count is known).

Here the groups are found; ``partition`` gives each grouped scan a region of
its own and orders the regions so that a group's are adjacent; lowering
emits a group as one loop where the way fuses loops (``jaxstreams.lower``).
"""

from __future__ import annotations

from typing import Sequence

LOOP_PRIMITIVE = "scan"


def groupable(eqn) -> bool:
  """Whether ``eqn`` is a scan that can join a group: no side effects (a
  group reorders work), and the plain forward or reverse loop ``lax.scan``
  makes."""
  return (eqn.primitive.name == LOOP_PRIMITIVE and not eqn.effects
          and not eqn.params.get("_split_transpose", False))


def loop_key(eqn) -> tuple:
  """What scans in one group share: their length and direction."""
  return (int(eqn.params["length"]), bool(eqn.params["reverse"]))


def find_groups(eqns: Sequence, sources: Sequence[Sequence[int]],
                streams: Sequence[int]) -> list[tuple[int, ...]]:
  """Groups of at least two scan equations (positions in ``eqns``, each
  group in program order) that can run as one loop: the same length and
  direction, each on a stream of its own (``streams[i]``), and none
  reading, directly or not, what another makes. Grouped greedily in program
  order, a scan joining the first group it fits."""
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
