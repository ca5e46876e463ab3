"""The suite's workloads, in the order they run.

Each module has ``NAME``, ``sizes(quick)`` (a list of size dicts) and
``build(size, streams, key)`` returning a ``common.Case``.
"""

from . import (control, dlrm, dual_encoder, gru_bank, inception, mlp_bank,
               ode_ensemble, staging)

WORKLOADS = [inception, dlrm, mlp_bank, dual_encoder, gru_bank, ode_ensemble,
             staging, control]
