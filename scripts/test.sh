#!/usr/bin/env bash
# Sets up a virtual environment in .venv (jaxstreams built from this checkout,
# with its test extras) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet ".[test]"
exec .venv/bin/pytest "$@"
