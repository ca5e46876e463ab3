#!/usr/bin/env bash
# Sets up a virtual environment in .venv (jaxstreams built from this checkout)
# and runs the demo: a two-tower training step on three streams.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet ".[examples]"
exec .venv/bin/python examples/streams_demo.py "$@"
