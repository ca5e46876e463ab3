#!/usr/bin/env bash
# jax 0.12 for the GPU machines, whose image has jax 0.11.2 only and no
# network: its wheels for CPython 3.12 (jax, jaxlib, the CUDA 13 plugin and
# PJRT, about 233 MB) cut into parts small enough for one device-tool call
# each (it carries 64 MiB), and put back together there.
#
#   bash scripts/gpu_wheels.sh split [VERSION]  # here: .whl/ gets the parts
#   bash scripts/gpu_wheels.sh join             # there: .whl/ gets the wheels,
#                                               # build/venv-jax installs them
#
# .whl/ is ignored by git; carry one part (or a few, under 64 MiB) per call
# (the device tool's `carry`: .whl/parts/<name>), then `join` and run
#   PYTHON=build/venv-jax/bin/python bash scripts/gpu_session.sh build gputests
set -euo pipefail
cd "$(dirname "$0")/.."
part_mb=${PART_MB:-60}
case ${1:-} in
  split)
    version=${2:-0.12.0.1}
    rm -rf .whl && mkdir -p .whl/wheels .whl/parts
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
      --python-version 3.12 --platform manylinux_2_27_x86_64 \
      --dest .whl/wheels "jax==$version" "jaxlib==$version" \
      "jax-cuda13-plugin==$version" "jax-cuda13-pjrt==$version"
    for wheel in .whl/wheels/*.whl; do
      split -b "${part_mb}m" -d "$wheel" ".whl/parts/$(basename "$wheel").part"
    done
    (cd .whl/parts && sha256sum ../wheels/*.whl | sed 's#\.\./wheels/##' > SHA256SUMS)
    ls -l .whl/parts
    ;;
  join)
    mkdir -p .whl/wheels
    for first in .whl/parts/*.part00; do
      wheel=$(basename "${first%.part00}")
      cat ".whl/parts/$wheel".part* > ".whl/wheels/$wheel"
    done
    (cd .whl/wheels && sha256sum -c ../parts/SHA256SUMS)
    python3 -m venv --system-site-packages build/venv-jax
    build/venv-jax/bin/python -m pip install --quiet --no-index --no-deps \
      .whl/wheels/*.whl
    build/venv-jax/bin/python -c 'import jax; print("jax", jax.__version__, jax.devices())'
    ;;
  *) echo "usage: $0 split [VERSION] | join" >&2; exit 2 ;;
esac
