"""Staging: hide input preparation and host-to-device copies behind compute.

* ``prefetch(iterable, size=2, ...)``: items placed on the device a bounded
  number ahead, by worker threads where that pays.
* ``stage(x)``: marks a stage boundary inside a step function.
* ``staged(step, data=iterable, ...)``: runs a step as a software pipeline,
  its producer part for the next batches beside its consumer part.

``_policy`` decides, for both, whether overlap pays. This file only
re-exports. The subpackage is ``staging`` because ``jaxstreams.stage`` is
the marker function, which a subpackage of that name would hide.
"""

from jaxstreams.staging._analysis import StagedPlan, stage
from jaxstreams.staging._runner import StagedRunner, staged, staged_plan
from jaxstreams.staging._prefetcher import Prefetcher, prefetch
from jaxstreams.staging._transfer import BY_PLATFORM_TRANSFER, TRANSFERS

__all__ = ["BY_PLATFORM_TRANSFER", "Prefetcher", "StagedPlan", "StagedRunner",
           "TRANSFERS", "prefetch", "stage", "staged", "staged_plan"]
