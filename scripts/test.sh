#!/usr/bin/env bash
# Sets up a virtual environment in .venv (jaxstreams built from this checkout,
# with its test extras) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet ".[test]"
# The CUDA plugin at exactly jaxlib's version, for the deviceless H100 compiles
# of tests/test_gpu_compile.py, which must then run rather than skip.
.venv/bin/python -m pip install --quiet "jax-cuda13-plugin==$(.venv/bin/python -c 'import jaxlib; print(jaxlib.__version__)')" "jax-cuda13-pjrt==$(.venv/bin/python -c 'import jaxlib; print(jaxlib.__version__)')"
export JAXSTREAMS_REQUIRE_GPU_TARGET=1
exec .venv/bin/pytest "$@"
