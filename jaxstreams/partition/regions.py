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

Independent scans on different streams that can run as one loop
(``partition.loops``) each get a region of their own, and the regions of
one such group are adjacent in the order, so that lowering can emit them
together.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Sequence

from jaxstreams.partition.cut import cut
from jaxstreams.partition.loops import find_groups
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
  # Groups of adjacent regions, each one scan, that can run as one loop.
  loops: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
  # Groups found but left apart (each scan its own loop), and why.
  loops_apart: dict[tuple[int, ...], str] = dataclasses.field(
      default_factory=dict)


def partition(program: ExposedProgram, eqn_streams: Sequence[int]
              ) -> RegionGraph:
  """Regions of ``program`` (an ``ExposedProgram``) for equation ``i`` on
  stream ``eqn_streams[i]``."""
  loop_groups = find_groups(program.jaxpr.eqns, program.sources, eqn_streams)
  visit, loop_groups = _visiting_order(program.sources, loop_groups)
  last_of_group = {group[-1]: group for group in loop_groups}
  alone = {i for group in loop_groups for i in group}
  region_of: list[int] = [-1] * len(program.sources)
  region_stream: list[int] = []
  region_eqns: list[list[int]] = []
  by_stream: dict[int, list[int]] = {}
  # Per region: bitmask of the regions it depends on, transitively. A region
  # runs as one call, so depending on any of its equations means depending on
  # everything the whole region waits for; a grouped scan runs with its
  # group, so depending on it means depending on everything they wait for.
  ancestors: list[int] = []

  for index in visit:
    stream = eqn_streams[index]
    pred_regions = {region_of[p] for p in program.sources[index]}
    chosen = None
    # Only the newest few regions of the stream are candidates: that finds
    # the merges blocks and independent work need, and keeps planning linear.
    # A grouped scan is a region of its own, which nothing else joins.
    for region in (() if index in alone else
                   reversed(by_stream.get(stream, ())[-CANDIDATES:])):
      bit = 1 << region
      if all(r == region or not ancestors[r] & bit for r in pred_regions):
        chosen = region
        break
    if chosen is None:
      chosen = len(region_stream)
      region_stream.append(stream)
      region_eqns.append([])
      ancestors.append(0)
      if index not in alone:
        by_stream.setdefault(stream, []).append(chosen)
    region_of[index] = chosen
    region_eqns[chosen].append(index)
    _add_ancestors(ancestors, chosen, pred_regions,
                   new=len(region_eqns[chosen]) == 1)
    if index in last_of_group:
      members = [region_of[i] for i in last_of_group[index]]
      shared = 0
      for r in members:
        shared |= ancestors[r] | (1 << r)
      for r in members:
        ancestors[r] = shared & ~(1 << r)

  groups = [tuple(region_of[i] for i in group) for group in loop_groups]
  order, groups = _topological_order(len(region_stream), program, region_of,
                                     groups)
  rank = {old: new for new, old in enumerate(order)}
  region_of = [rank[r] for r in region_of]
  graph = _describe(program, region_of,
                    [region_stream[old] for old in order],
                    [region_eqns[old] for old in order])
  graph.loops = [tuple(sorted(rank[r] for r in group)) for group in groups]
  return graph


def _visiting_order(sources, groups) -> tuple[list[int], list[tuple[int, ...]]]:
  """The equations in an order that respects their data (program order
  among the ready ones) with each group's scans next to each other, and
  the groups kept (``_grouped_order``). Without groups, program order."""
  count = len(sources)
  if not groups:
    return list(range(count)), []
  succ: list[set[int]] = [set() for _ in range(count)]
  for i, srcs in enumerate(sources):
    for p in srcs:
      succ[p].add(i)
  return _grouped_order(count, succ, groups)


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


def _topological_order(count, program, region_of, groups=()
                       ) -> tuple[list[int], list[tuple[int, ...]]]:
  """Regions sorted so each comes after those it reads from (ties broken by
  creation order), the regions of each of ``groups`` next to each other;
  and the groups kept (``_grouped_order``)."""
  succ: list[set[int]] = [set() for _ in range(count)]
  for index, sources in enumerate(program.sources):
    mine = region_of[index]
    for p in sources:
      theirs = region_of[p]
      if theirs != mine:
        succ[theirs].add(mine)
  return _grouped_order(count, succ, groups)


def _grouped_order(count: int, succ: list[set[int]], groups
                   ) -> tuple[list[int], list[tuple[int, ...]]]:
  """Nodes ``0..count-1`` (``succ[i]``: the nodes that need ``i``) in an
  order that respects ``succ``, lowest number first among the ready ones
  (Kahn's algorithm), each group's nodes next to each other, and the groups
  kept. A group that would close a cycle once its nodes sit together (one
  of them feeds work that a node of another group needs, and the other way
  round) is dropped, the last first."""
  groups = list(groups)
  while True:
    order = _kahn(count, succ, groups)
    if order is not None:
      return order, groups
    if not groups:  # the cycle test in partition makes this unreachable
      raise AssertionError("jaxstreams: region graph has a cycle")
    groups.pop()


def _kahn(count, succ, groups) -> list[int] | None:
  """The order with each group as one node (None: that closes a cycle)."""
  leader = list(range(count))
  members: dict[int, tuple[int, ...]] = {}
  for group in groups:
    first = min(group)
    members[first] = tuple(sorted(group))
    for r in group:
      leader[r] = first
  indegree = [0] * count
  next_of: list[set[int]] = [set() for _ in range(count)]
  for a in range(count):
    for b in succ[a]:
      la, lb = leader[a], leader[b]
      if la != lb and lb not in next_of[la]:
        next_of[la].add(lb)
        indegree[lb] += 1
  ready = [r for r in range(count) if leader[r] == r and indegree[r] == 0]
  heapq.heapify(ready)
  order = []
  while ready:
    node = heapq.heappop(ready)
    order.extend(members.get(node, (node,)))
    for nxt in next_of[node]:
      indegree[nxt] -= 1
      if indegree[nxt] == 0:
        heapq.heappush(ready, nxt)
  return order if len(order) == count else None


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
  """The edges of a DAG (nodes topologically numbered) that no longer path
  implies."""
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
