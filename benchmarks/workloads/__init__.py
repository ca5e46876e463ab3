"""The suite's workloads, in the order they run.

Each module has ``NAME``, ``sizes(quick)`` (a list of size dicts) and
``build(size, streams, key)`` returning a ``common.Case``.
"""

from . import control, dlrm, inception, mlp_bank, staging

WORKLOADS = [inception, dlrm, mlp_bank, staging, control]
