"""Which way the default takes where nothing times the ways: each program
of the compile matrix lowered for an H100 on a machine without one.

No GPU, no timing. Each program (``tests/compile_matrix.py``) is lowered
for ``gpu_target("h100").abstract(...)`` twice: with
``jaxstreams_estimate_target=none`` (the structural default,
``gpu.default_top_level``) and with the default (``auto``: the candidate
structural way and ``jax.jit``'s program compiled for the target the
arguments are on; the structural way stands unless the estimate predicts a
loss beyond its held-out error, and always for a kind of program no GPU
run measured: ``jaxstreams.choose.estimated``). Per program: both ways,
whether they agree, each way's estimated step and bound, the rule that
decided, and the seconds the estimate took (its compiles, in one child
process; no decision is read from disk).

Needs the CUDA plugin at jaxlib's version (``jaxstreams.xla.target``).

  JAX_PLATFORMS=cpu python benchmarks/estimated_default.py [--quick] [--out DIR]
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests"),
                os.path.join(HERE, "..", "examples")]

import jax  # noqa: E402

import _common  # noqa: E402
import jaxstreams  # noqa: E402
from compile_matrix import PROGRAMS  # noqa: E402

QUICK = ("scan_towers", "dual_encoders", "demo", "inception")


def default_way(fn, args, streams, estimate: str) -> tuple[str, str, float]:
  """The way, the reason and the seconds of a fresh function's default for
  these (target-placed) arguments, with ``jaxstreams_estimate_target``
  set to ``estimate``."""
  jaxstreams.config.update("jaxstreams_estimate_target", estimate)
  try:
    start = time.perf_counter()
    plan = jaxstreams.jit(fn, streams=streams).plan(*args)
    return plan.gpu_lowering, plan.gpu_reason, time.perf_counter() - start
  finally:
    jaxstreams.config.reset("jaxstreams_estimate_target")


def main():
  p = _common.parser(__doc__.splitlines()[0], f"only {', '.join(QUICK)}")
  options = p.parse_args()
  # Every estimate made here, none read from decisions kept on disk; and
  # nothing timed, on a machine with a GPU too.
  jaxstreams.config.update("jaxstreams_autotune_cache", "none")
  jaxstreams.config.update("jaxstreams_autotune", False)
  target = jaxstreams.gpu_target("h100")
  names = QUICK if options.quick else tuple(PROGRAMS)
  result = {"machine": _common.machine(), "target": "h100 (deviceless)",
            "jax": jax.__version__, "programs": {}}
  lines = [f"The default's way where nothing times the ways, lowered for an "
           f"H100 without one; jax {jax.__version__}",
           "program: structural -> estimated (seconds the estimate took)"]
  agree = 0
  for name in names:
    fn, args, streams = PROGRAMS[name]()
    placed = target.abstract(*args)
    structural, _, _ = default_way(fn, placed, streams, "none")
    estimated, why, seconds = default_way(fn, placed, streams, "auto")
    agree += structural == estimated
    result["programs"][name] = {"structural": structural,
                                "estimated": estimated, "reason": why,
                                "estimate_seconds": seconds}
    lines.append(f"{name}: {structural} -> {estimated} ({seconds:.0f} s)")
    lines.append(f"    {why.split('; inside another jit')[0]}")
    print("\n".join(lines[-2:]), flush=True)
  lines.append(f"agree: {agree} of {len(names)}")
  suffix = "_quick" if options.quick else ""
  # Compiled for an H100 (without one): its results are the H100's.
  path = _common.save(options.out or _common.results_folder("h100"),
                      f"estimated_default_h100_jax{jax.__version__}{suffix}",
                      result, "\n".join(lines) + "\n")
  print(lines[-1])
  print("saved", path)


if __name__ == "__main__":
  main()
