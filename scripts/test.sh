#!/usr/bin/env bash
# Sets up a virtual environment (jaxstreams built from this checkout, with its
# test extras) and runs the test suite in parallel workers (pytest-xdist).
# Extra arguments go to pytest (`-n 0` runs it in one process).
#
# As is, this is the README's test command: python3 (3.11 here) in .venv, jax
# as pip resolves it, the quick tier (every test but those marked `slow`,
# the property test with 20 examples; tests/conftest.py says what is left
# out): within 8 minutes on 2 cores, setup included.
#   JAXSTREAMS_TEST_TIER    all: every test, `slow` ones included (CI)
# The same script runs the suite on another jax:
#   JAXSTREAMS_TEST_PYTHON  interpreter that makes the venv (default python3)
#   JAXSTREAMS_TEST_VENV    venv directory (default .venv)
#   JAXSTREAMS_TEST_JAX     jax and jaxlib version installed before the project
#                           (default: none pinned, pip's choice)
#   JAXSTREAMS_TEST_WHEEL   a jaxstreams wheel to install instead of building
#                           one (every run leaves the one it built in
#                           build/wheel/; it serves every CPython 3)
#   JAXSTREAMS_TEST_WORKERS pytest workers (default 2; the tests run on CPU,
#                           and each worker is a JAX process of its own)
# e.g. JAXSTREAMS_TEST_PYTHON=python3.12 JAXSTREAMS_TEST_VENV=.venv-0.12 \
#      JAXSTREAMS_TEST_JAX=0.12.0.1 bash scripts/test.sh -q
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${JAXSTREAMS_TEST_VENV:-.venv}
"${JAXSTREAMS_TEST_PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
if [ -n "${JAXSTREAMS_TEST_JAX:-}" ]; then
  "$venv/bin/python" -m pip install --quiet "jax==$JAXSTREAMS_TEST_JAX" "jaxlib==$JAXSTREAMS_TEST_JAX"
fi
wheel=${JAXSTREAMS_TEST_WHEEL:-}
if [ -z "$wheel" ]; then
  rm -rf build/wheel
  "$venv/bin/python" -m pip wheel --quiet --no-deps --wheel-dir build/wheel .
  wheel=$(ls build/wheel/jaxstreams-*.whl)
fi
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheel"
"$venv/bin/python" -m pip install --quiet "$wheel[test]"
# The CUDA plugin at exactly jaxlib's version, for the deviceless H100 compiles
# of tests/test_gpu_compile.py, which must then run rather than skip.
jaxlib_version=$("$venv/bin/python" -c 'import jaxlib; print(jaxlib.__version__)')
"$venv/bin/python" -m pip install --quiet "jax-cuda13-plugin==$jaxlib_version" "jax-cuda13-pjrt==$jaxlib_version"
export JAXSTREAMS_REQUIRE_GPU_TARGET=1
tier=()
if [ "${JAXSTREAMS_TEST_TIER:-quick}" != all ]; then
  tier=(-m "not slow")
  export JAXSTREAMS_PROPERTY_EXAMPLES=${JAXSTREAMS_PROPERTY_EXAMPLES:-20}
fi
# worksteal: a worker that runs out of tests takes some of the other's, so
# the run does not end on one worker's long tail.
exec "$venv/bin/pytest" -n "${JAXSTREAMS_TEST_WORKERS:-2}" --dist worksteal \
  "${tier[@]}" "$@"
