#!/usr/bin/env bash
# The packages of the models users write (benchmarks/workloads/: flax.linen,
# flax.nnx, equinox, optax) for the GPU machines, which have no network:
# pure wheels for CPython 3.12 on x86-64 Linux (the GPU image's Python),
# installed without their dependencies into one folder of about 21 MB that
# the device tool carries (its `carry`: .models-site). Only what the models
# import: flax's checkpointing packages (orbax, tensorstore) stay out.
#
#   bash scripts/model_packages.sh            # here: makes .models-site/
#
# PYTHON: a Python 3.12 interpreter to run pip (default: python3.12).
#   bash scripts/gpu_session.sh models        # there: finds it on its own
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.models-site}
rm -rf "$dest"
py=${PYTHON:-python3.12}
"$py" -m pip install --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --platform manylinux2014_x86_64 --target "$dest" \
  flax==0.12.12 optax==0.2.8 equinox==0.13.8 jaxtyping==0.3.11 \
  wadler_lindig==0.1.8 treescope==0.1.10 msgpack==1.2.4 \
  typing_extensions==4.16.0 PyYAML==6.0.4 rich==15.0.0 markdown-it-py==4.3.0 \
  mdurl==0.1.2
du -sh "$dest"
