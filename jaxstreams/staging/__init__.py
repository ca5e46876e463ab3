"""Staging: hide input preparation and host-to-device copies behind compute.

``prefetch`` places items on the device ahead of use; ``staged`` runs a
step as a pipeline over the parts ``stage(x)`` marks (``tag.boundary``)
and ``partition.stages`` cuts; ``_policy`` decides whether overlap pays.
(Not ``stage/``: it would hide ``jaxstreams.stage``.)
"""

from jaxstreams.partition.stages import StagedPlan
from jaxstreams.tag.boundary import stage
from jaxstreams.staging._runner import StagedRunner, staged, staged_plan
from jaxstreams.staging._prefetcher import Prefetcher, prefetch
from jaxstreams.staging._transfer import BY_PLATFORM_TRANSFER, TRANSFERS

__all__ = ["BY_PLATFORM_TRANSFER", "Prefetcher", "StagedPlan", "StagedRunner",
           "TRANSFERS", "prefetch", "stage", "staged", "staged_plan"]
