"""Staging: hide input preparation and host-to-device copies behind compute.

* ``prefetch(iterable, size=2, ...)``: a host iterator whose items are put on
  the device by worker threads, a bounded number of items ahead.
* ``stage(x)``: marks a stage boundary inside a step function.
* ``staged(step, data=iterable, ...)``: runs a step as a software pipeline
  (TensorFlow's staging areas, DeepRec's SmartStage): the producer part of the
  step (what computes the staged values from the data argument) runs for the
  next batches while the consumer part runs for this one; by default in one
  program per call, the producer on a stream of its own (``mode="fused"``),
  or in worker threads (``mode="threads"``).

Modules: for ``prefetch``, ``_prefetcher`` (``Prefetcher``, ``prefetch()``),
``_prefetch_checks`` (its arguments), ``_lookahead`` (the pipeline of
workers or the consumer's thread), ``_transfer`` (how items reach the
device; ``TRANSFERS`` and ``BY_PLATFORM_TRANSFER`` are exported here); ``_chooser``
(whether overlap pays, for ``prefetch`` and ``staged``) and ``_clock`` (what
both measure themselves with); for ``staged``, ``_marker``
(``stage(x)``), ``_analysis`` (how a step is split), ``_plan`` (the
``StagedPlan`` report), ``_splits`` (the split a batch uses, cached),
``_fused`` and ``_threads`` (the two runs) and ``_runner`` (``staged``, its
runner and ``staged_plan``). This file only re-exports.

The subpackage is ``staging``, not ``stage``: ``jaxstreams.stage`` is the
marker function (the package exports it), and a subpackage of that name
would be hidden behind it; for the same reason no module here is named
after a function it exports.
"""

from jaxstreams.staging._marker import stage
from jaxstreams.staging._plan import StagedPlan
from jaxstreams.staging._runner import StagedRunner, staged, staged_plan
from jaxstreams.staging._prefetcher import Prefetcher, prefetch
from jaxstreams.staging._transfer import BY_PLATFORM_TRANSFER, TRANSFERS

__all__ = ["BY_PLATFORM_TRANSFER", "Prefetcher", "StagedPlan", "StagedRunner",
           "TRANSFERS", "prefetch", "stage", "staged", "staged_plan"]
