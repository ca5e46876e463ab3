"""A server's counters (``Server.stats()``): what its requests did, per
model and in all, for tests and monitoring (not timings)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelStats:
  """One model's counts: requests admitted, completed, failed (its own
  error) and cancelled (a future cancelled before its batch was built)."""
  requests: int
  completed: int
  failed: int
  cancelled: int = 0


@dataclasses.dataclass(frozen=True)
class ServeStats:
  """Counters of a server, for tests and monitoring (not timings).

  ``requests``, ``completed``, ``failed``, ``cancelled``: over every model;
  ``models``: the same per model name. ``direct``: requests run as plain
  ``jax.jit`` calls in their caller's thread. ``batches``, ``batch_sizes``
  (requests per execution -> executions): grouped executions.
  ``signatures_traced``: times a model was traced (once per request
  signature while cached). ``programs_traced``: batch programs traced (once
  per combination of request signatures while cached). ``fallbacks``:
  batches rerun request by request after their execution failed. ``mode``:
  ``"direct"`` or ``"grouped"``; ``mode_reason`` says why (with the
  measurements, where they decided).
  """
  requests: int
  completed: int
  failed: int
  batches: int
  batch_sizes: dict[int, int]
  signatures_traced: int
  programs_traced: int
  programs_cached: int
  program_evictions: int
  fallbacks: int
  mode: str = "grouped"
  mode_reason: str = ""
  direct: int = 0
  cancelled: int = 0
  models: dict[str, ModelStats] = dataclasses.field(default_factory=dict)
