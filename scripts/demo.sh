#!/usr/bin/env bash
# Sets up a virtual environment in .venv (jaxstreams built from this checkout)
# and runs the demo: a two-tower training step on three streams.
#
# Without a GPU (no working nvidia-smi) it also installs the CUDA PJRT plugin
# at jaxlib's version (about 400 MB, no driver needed) and runs with
# JAX_PLATFORMS=cpu, so the demo can show the program XLA compiles for an
# H100 (its CUDA graphs). JAXSTREAMS_DEMO_PLUGIN=0 skips that install.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet ".[examples]"
if ! nvidia-smi -L >/dev/null 2>&1; then
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
  if [ "${JAXSTREAMS_DEMO_PLUGIN:-1}" != 0 ]; then
    version=$(.venv/bin/python -c 'import jaxlib; print(jaxlib.__version__)')
    .venv/bin/python -m pip install --quiet "jax-cuda13-plugin==$version" "jax-cuda13-pjrt==$version" \
      || echo "demo: the CUDA plugin could not be installed; the H100 graphs are left out" >&2
  fi
fi
exec .venv/bin/python examples/streams_demo.py "$@"
