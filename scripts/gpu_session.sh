#!/usr/bin/env bash
# Everything a session with a GPU should run, in one go, on the GPU machine
# (no network there: it builds in place against the image's jax/jaxlib,
# scikit-build-core, cmake and nvcc). Writes every log under OUT_DIR
# (default $OUT, else benchmarks/results/gpu) for committing with the device
# name and jax version. Not yet run: no GPU was lent to the sessions so far.
#
#   bash scripts/gpu_session.sh            # probe, build, GPU tests, benchmarks
#   QUICK=1 bash scripts/gpu_session.sh    # benchmark suite in --quick mode
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-${OUT:-benchmarks/results/gpu}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
} 2>&1 | tee "$out/device.txt"

# 1. Does XLA run stream-annotated calls concurrently here at all?
if [ -f ../shared/gpu/overlap_probe.py ]; then probe=../shared/gpu/overlap_probe.py
else probe=shared/gpu/overlap_probe.py; fi
"$py" "$probe" 2>&1 | tee "$out/overlap_probe.txt"

# 2. Build the package in place (both native libraries) into a target dir.
"$py" -m pip install --no-build-isolation --no-deps --target /tmp/jaxstreams-site . \
  2>&1 | tail -5 | tee "$out/build.txt"
export PYTHONPATH=/tmp/jaxstreams-site${PYTHONPATH:+:$PYTHONPATH}

# 3. The whole test suite, GPU tests required to run.
JAXSTREAMS_REQUIRE_GPU=1 "$py" -m pytest -q -p no:cacheprovider tests 2>&1 \
  | tee "$out/tests.txt"

# 4. compute-sanitizer over the runtime's GPU tests.
if command -v compute-sanitizer >/dev/null; then
  JAXSTREAMS_REQUIRE_GPU=1 compute-sanitizer --tool memcheck "$py" -m pytest -q \
    -p no:cacheprovider tests/test_runtime_gpu.py 2>&1 | tail -30 | tee "$out/sanitizer.txt"
fi

# 5. Benchmarks (each prints ratios taken in one run and saves JSON).
suite_args=(--out "$out")
[ "${QUICK:-0}" = 1 ] && suite_args+=(--quick)
"$py" benchmarks/suite.py "${suite_args[@]}" 2>&1 | tee "$out/suite.txt"
"$py" benchmarks/jit_overhead.py --out "$out" 2>&1 | tee "$out/jit_overhead.txt"
"$py" benchmarks/prefetch.py --out "$out" 2>&1 | tee "$out/prefetch.txt"
"$py" benchmarks/serve.py --out "$out" 2>&1 | tee "$out/serve.txt"
"$py" examples/streams_demo.py 2>&1 | tee "$out/streams_demo.txt"
echo "logs in $out"
