"""``StagedPlan``: how ``staged`` split a step, for people to read (built
beside the ``Split`` the runs use, never read by them)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StagedEquation:
  index: int            # position in the step's jaxpr
  primitive: str
  source: str           # file:line (function) of the user code
  level: int | None     # None: reads a non-data argument or has effects
  constant: bool = False  # reads no argument: run by every part that needs it


@dataclasses.dataclass(frozen=True)
class StageSpec:
  index: int
  kind: str             # "producer" or "consumer"
  equations: tuple[StagedEquation, ...]
  inputs: int           # values it receives (the consumer: besides arguments)
  outputs: int          # values it hands on


@dataclasses.dataclass(frozen=True)
class StagedPlan:
  """How ``staged`` split a step: ``stages`` (producers first, the consumer
  last), ``boundaries`` (source of each ``stage()`` call and its level) and
  whether SmartStage chose the producer (``smart``)."""

  function_name: str
  smart: bool
  data_argnums: int     # the data argument's position, from 0
  stages: tuple[StageSpec, ...]
  boundaries: tuple[tuple[int, str], ...]

  @property
  def producers(self) -> tuple[StageSpec, ...]:
    return self.stages[:-1]

  @property
  def consumer(self) -> StageSpec:
    return self.stages[-1]

  def __str__(self) -> str:
    how = "smart (widest data-only subgraph)" if self.smart else "stage() calls"
    lines = [f"StagedPlan {self.function_name}: {len(self.producers)} producer "
             f"stage(s) + consumer, data argument {self.data_argnums}, "
             f"split by {how}"]
    for level, source in self.boundaries:
      lines.append(f"  boundary -> level {level}: stage() at {source}")
    for spec in self.stages:
      lines.append(f"  stage {spec.index} ({spec.kind}): {len(spec.equations)} "
                   f"equation(s), {spec.inputs} in, {spec.outputs} out")
      for eqn in spec.equations:
        level = "-" if eqn.level is None else eqn.level
        kind = "const" if eqn.constant else ""
        lines.append(f"    [{eqn.index:3d}] {eqn.primitive:<24} level {level:<2} "
                     f"{kind:<6}{eqn.source}")
    return "\n".join(lines)
