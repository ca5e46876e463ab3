"""Partition: equations with streams become regions, and regions a DAG.

A region is a group of equations on one stream that is emitted as one call
(or, on the main stream, inline). Regions are grown greedily in program
order: an equation joins an existing region of its stream unless that would
close a cycle, i.e. unless one of its inputs was computed outside the region
from something the region produced. This keeps a user's ``with stream(1):``
block one call, and merges independent equations of a stream as well.

Each region carries the set of regions it transitively depends on, as a
bitmask, so the cycle test is a few integer operations per input. What each
region reads and makes comes from ``cut``, as for staging's parts.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Sequence

from jaxstreams.partition.cut import cut
from jaxstreams.tag.read import ExposedProgram


CANDIDATES = 4


@dataclasses.dataclass
class RegionGraph:
  """Regions in emission (topological) order and the edges between them."""
  streams: list[int]                     # stream of each region
  members: list[list[int]]               # equation indices of each region
  inputs: list[list[Any]]                # vars each region reads from outside
  outputs: list[list[Any]]               # vars each region makes for others
  edges: dict[tuple[int, int], list[Any]]  # (producer, consumer) -> vars
  region_of: list[int]                   # region of each equation


def partition(program: ExposedProgram, eqn_streams: Sequence[int]
              ) -> RegionGraph:
  """Regions of ``program`` (an ``ExposedProgram``) for equation ``i`` on
  stream ``eqn_streams[i]``."""
  region_of: list[int] = []
  region_stream: list[int] = []
  region_eqns: list[list[int]] = []
  by_stream: dict[int, list[int]] = {}
  # Per region: bitmask of the regions it depends on, transitively. A region
  # runs as one call, so depending on any of its equations means depending on
  # everything the whole region waits for.
  ancestors: list[int] = []

  for index, sources in enumerate(program.sources):
    stream = eqn_streams[index]
    pred_regions = {region_of[p] for p in sources}
    chosen = None
    # Only the newest few regions of the stream are candidates: that finds
    # the merges blocks and independent work need, and keeps planning linear.
    for region in reversed(by_stream.get(stream, ())[-CANDIDATES:]):
      bit = 1 << region
      if all(r == region or not ancestors[r] & bit for r in pred_regions):
        chosen = region
        break
    if chosen is None:
      chosen = len(region_stream)
      region_stream.append(stream)
      region_eqns.append([])
      ancestors.append(0)
      by_stream.setdefault(stream, []).append(chosen)
    region_of.append(chosen)
    region_eqns[chosen].append(index)
    _add_ancestors(ancestors, chosen, pred_regions,
                   new=len(region_eqns[chosen]) == 1)

  order = _topological_order(len(region_stream), program, region_of)
  rank = {old: new for new, old in enumerate(order)}
  region_of = [rank[r] for r in region_of]
  return _describe(program, region_of,
                   [region_stream[old] for old in order],
                   [region_eqns[old] for old in order])


def _add_ancestors(ancestors: list[int], region: int, pred_regions,
                   new: bool) -> None:
  """Record that ``region`` now reads from ``pred_regions``, and pass the new
  ancestry on to every region that already depends on ``region`` (a region
  created for this very equation has none yet, which is the common case)."""
  added = 0
  for r in pred_regions:
    if r != region:
      added |= ancestors[r] | (1 << r)
  added &= ~ancestors[region]
  if not added:
    return
  ancestors[region] |= added
  if new:
    return
  bit = 1 << region
  for other, mask in enumerate(ancestors):
    if mask & bit:
      ancestors[other] = mask | added


def _topological_order(count, program, region_of) -> list[int]:
  """Regions sorted so each comes after those it reads from (Kahn's
  algorithm, ties broken by creation order)."""
  succ: list[set[int]] = [set() for _ in range(count)]
  indegree = [0] * count
  for index, sources in enumerate(program.sources):
    mine = region_of[index]
    for p in sources:
      theirs = region_of[p]
      if theirs != mine and mine not in succ[theirs]:
        succ[theirs].add(mine)
        indegree[mine] += 1
  ready = [r for r in range(count) if indegree[r] == 0]
  heapq.heapify(ready)
  order = []
  while ready:
    region = heapq.heappop(ready)
    order.append(region)
    for nxt in succ[region]:
      indegree[nxt] -= 1
      if indegree[nxt] == 0:
        heapq.heappush(ready, nxt)
  if len(order) != count:  # the cycle test above makes this unreachable
    raise AssertionError("jaxstreams: region graph has a cycle")
  return order


def _describe(program, region_of, streams, members) -> RegionGraph:
  parts = cut(program.jaxpr, members)
  edges: dict[tuple[int, int], list[Any]] = {}
  for region, part in enumerate(parts):
    for v in part.inputs:
      made_by = program.producer_of(v)
      if made_by is not None:
        edges.setdefault((region_of[made_by], region), []).append(v)
  return RegionGraph(streams, members, [list(p.inputs) for p in parts],
                     [list(p.outputs) for p in parts], edges, region_of)


def transitive_reduction(count: int, edges) -> set[tuple[int, int]]:
  """The edges of a DAG (nodes topologically numbered) that no longer path implies."""
  succ: list[set[int]] = [set() for _ in range(count)]
  for a, b in edges:
    succ[a].add(b)
  reach = [0] * count   # bitmask of nodes reachable from each node
  for node in reversed(range(count)):
    mask = 0
    for nxt in succ[node]:
      mask |= reach[nxt] | (1 << nxt)
    reach[node] = mask
  kept = set()
  for a, b in edges:
    implied = any(c != b and reach[c] >> b & 1 for c in succ[a])
    if not implied:
      kept.add((a, b))
  return kept
