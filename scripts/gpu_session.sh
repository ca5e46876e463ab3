#!/usr/bin/env bash
# Everything a session with a GPU should run, on the GPU machine itself (no
# network there: it builds in place with the image's jaxlib headers, cmake
# and nvcc, and runs against the image's jax).
#
#   bash scripts/gpu_session.sh                 # every step, in order
#   bash scripts/gpu_session.sh build tests     # only the steps named
#
# Steps: info probe build gputests tests sanitizer suite levers towers loops
#        models fixtures serve overhead firstcall sweep sweeplong prefetch demo
#
# One call runs at most 10 minutes and a session may get as little as 15
# in all, machine starts included, so a session runs them in parts. On an
# H100 "info probe build gputests tests levers overhead demo" took 5 minutes
# (gputests 70 s, tests 90 s, levers 70 s); "prefetch sweep" then needs a
# second call on the warm machine (sweep: 5 rounds took about 2 minutes per
# 0.1 ms row and ran out of time after two of the four rows; the default is
# now 2 rounds, 6 under 1 ms).
# (levers: every GPU way of the suite's programs, the default's own choice
# and kernel overlap from a profiler trace: benchmarks/gpu_levers.py).
# (towers: the dual encoder of two scanned transformer towers, forward and
# training step; loops: the GRU bank, the ODE ensemble and the
# Inception-style model; both benchmarks/gpu_levers.py --models ..., with
# PyTorch on the same weights, one stream and a stream per tower, and kernel
# overlap from traces, TOWERS_ROUNDS / LOOPS_ROUNDS rounds, default 5; not
# yet run on a GPU).
# (models: the models users write, benchmarks/gpu_levers.py --models models:
# flax.linen dual encoders of 12 and 12 and of 24 and 12 scanned layers,
# forward and optax training step, a checkpointed tower, flax.nnx and
# equinox dual encoders, a multi-task model with scanned heads; the linen
# ones against PyTorch on their weights, a CUDA stream per tower; XLA's
# memory analysis of each program and PyTorch's measured peak beside each
# timing; MODELS_ROUNDS rounds, default 3; MODELS_LIST, default all, names
# joined by commas for a part. flax, optax and equinox travel in
# .models-site: run scripts/model_packages.sh here and carry it. Not yet run
# on a GPU.)
# (fixtures: XLA's command-buffer log and thunk dump of the tests' programs
# compiled on this GPU, into $LOGS/fixtures; on an H100 they belong in
# benchmarks/results/h100/jax<version>/fixtures, where tests/test_gpu_fixtures.py checks
# the deviceless view against them on every CI run.)
# (With PYTHON set to another interpreter, every step runs on its jax: jax
# 0.12 travels to the GPU machine as wheel parts, scripts/gpu_wheels.sh.)
# (overhead: the per-call cost only; firstcall: jaxstreams.jit's first call
# against jax.jit's and the calls and seconds until it chose its way, for
# FIRSTCALL_MODELS, default the suite's six models ("suite,demo,transformer"
# adds the demo step and a 12-layer transformer step), FIRSTCALL_ROUNDS
# paired rounds, default 2: benchmarks/jit_overhead.py).
# (serve: benchmarks/serve.py, three models at 1 to 64 client threads
# against jax.jit, vmap batching and PyTorch with a CUDA stream per thread;
# SERVE_ROUNDS rounds of 0.3 s, default 4: about 90 s of timing plus
# compiles, run it in a call of its own; --trace profiles jax.jit and grouped
# at 64 threads: kernels per GPU stream; not yet run on a GPU)
# (sweep: prefetch_sweep's steps under 1 ms, SWEEP_ROUNDS rounds, default 2,
# three times that under 1 ms; sweeplong: 1 to 10 ms, LONG_ROUNDS, default 3)
#
# Each step writes its log to $LOGS/<step>.txt (default the folder of this
# device's and jax's current results, benchmarks/results/<device>/jax<version>)
# and the benchmarks save their JSON there too. The device tool returns at
# most 8 files from $OUT, so when $OUT is set the whole log folder is packed
# into $OUT/gpu_logs.tgz after every step: a call cut off at its time limit
# still returns every step that finished. Each step runs under its own time
# limit (TIMEOUT_<STEP>=seconds overrides it), cut short to end BUDGET
# seconds after the script started (default 570: the device tool's 10-minute
# limit on one command, less time to pack), and a failing step does not stop
# the next one. The build goes to build/gpu, which stays between calls
# to a machine that is still warm; later calls find it there.
set -uo pipefail
cd "$(dirname "$0")/.."
deadline=$(( $(date +%s) + ${BUDGET:-570} ))
py=${PYTHON:-python3}
logs=${LOGS:-$("$py" -c 'import sys; sys.path.insert(0, "benchmarks"); import _common; print(_common.results_folder())')}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d build/gpu/lib ]; then export JAXSTREAMS_FFI_LIB_DIR=$PWD/build/gpu/lib; fi
# flax, optax and equinox for the models step (scripts/model_packages.sh),
# after the image's own packages.
if [ -d .models-site ]; then export PYTHONPATH=$PYTHONPATH:$PWD/.models-site; fi

pack() {
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/gpu_logs.tgz" -C "$logs" .; fi
}

run_step() {  # name default_timeout, then the command
  local name=$1 limit=$2 var status
  shift 2
  var=TIMEOUT_$(tr '[:lower:]' '[:upper:]' <<<"$name")
  limit=${!var:-$limit}
  local left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 10 ]; then echo "=== $name skipped: budget spent"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  SECONDS=0
  timeout --kill-after=10 "$limit" "$@" >"$logs/$name.txt" 2>&1
  status=$?
  echo "exit $status after ${SECONDS}s" >>"$logs/$name.txt"
  tail -4 "$logs/$name.txt"
  pack
}

step_info() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
  "$py" -m pip list 2>/dev/null | grep -Ei '^(jax|jaxlib|jax-cuda|numpy|pytest|hypothesis|cmake|ninja) '
  command -v nvcc cmake ninja compute-sanitizer
  nvcc --version | tail -2
}

step_probe() {
  local probe=../shared/gpu/overlap_probe.py
  [ -f "$probe" ] || probe=shared/gpu/overlap_probe.py
  "$py" "$probe"
}

# The GPU image's default compiler (CXX=/opt/gcc/bin/g++) put libstdc++'s
# own code into our libraries (gdb showed std::ostream internals inside
# libjaxstreams_cpu.so), and that copy crashed in the CPU library's first
# string formatting, inside a process where jaxlib had loaded the system
# libstdc++ (H100 machine, 2026-11-24). The system g++ links libstdc++.so.6
# like every other extension: build with it.
step_build() {
  local gen=() cxx=${JAXSTREAMS_CXX:-/usr/bin/g++}
  command -v ninja >/dev/null && gen=(-G Ninja)
  [ -x "$cxx" ] && export CXX=$cxx CUDAHOSTCXX=$cxx
  cmake -S ffi -B build/gpu "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DJAXSTREAMS_REQUIRE_CUDA=ON -DPython_EXECUTABLE="$(command -v "$py")" &&
    cmake --build build/gpu -j 16 && ls -l build/gpu/lib &&
    readelf -d build/gpu/lib/libjaxstreams_cpu.so | grep NEEDED
}

export GPU_TEST_FILES="tests/test_gpu_core.py tests/test_runtime_gpu.py
  tests/test_gpu_compile.py tests/test_xla_schedule.py tests/test_gpu_graphs.py
  tests/test_xla_graph.py tests/test_autotune.py tests/test_gpu_lowering.py
  tests/test_loops.py"

step_gputests() {  # the GPU tests on their own, one process, full tracebacks
  JAXSTREAMS_REQUIRE_GPU=1 "$py" -X faulthandler -m pytest -p no:cacheprovider \
    -p no:benchmark -q -rfEsxX --durations=15 $GPU_TEST_FILES
}

step_tests() {  # the rest of the suite, with the GPU as JAX's default device
  local par=()
  "$py" -c 'import xdist' 2>/dev/null && par=(-n 8)
  # pytest-benchmark (installed there) warns under xdist, and the suite turns
  # warnings into errors: leave that plugin out.
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAXSTREAMS_REQUIRE_GPU=1 "$py" -X faulthandler \
    -m pytest -p no:cacheprovider -p no:benchmark -q -rfEsxX --tb=short \
    --durations=25 "${par[@]}" \
    $(printf -- '--ignore=%s ' $GPU_TEST_FILES) tests
}

step_sanitizer() {
  JAXSTREAMS_REQUIRE_GPU=1 compute-sanitizer --tool memcheck "$py" -m pytest -q \
    -p no:cacheprovider tests/test_runtime_gpu.py
}

export py
export -f step_info step_probe step_build step_gputests step_tests step_sanitizer
all_steps=(info probe build gputests tests sanitizer suite levers towers loops models fixtures serve overhead firstcall sweep sweeplong prefetch demo)
steps=("$@")
[ ${#steps[@]} = 0 ] && steps=("${all_steps[@]}")
for s in "${steps[@]}"; do
  case $s in
    info)      run_step info 60 bash -c step_info ;;
    probe)     run_step probe 180 bash -c step_probe ;;
    build)     run_step build 300 bash -c step_build
               [ -d build/gpu/lib ] && export JAXSTREAMS_FFI_LIB_DIR=$PWD/build/gpu/lib ;;
    gputests)  run_step gputests 240 bash -c step_gputests ;;
    tests)     run_step tests 420 bash -c step_tests ;;
    sanitizer) run_step sanitizer 240 bash -c step_sanitizer ;;
    suite)     run_step suite 300 "$py" benchmarks/suite.py --out "$logs" ;;
    levers)    run_step levers 420 "$py" benchmarks/gpu_levers.py --trace \
                 --rounds "${LEVERS_ROUNDS:-9}" --out "$logs" ;;
    towers)    run_step towers 540 "$py" benchmarks/gpu_levers.py --trace \
                 --models dual_encoder,dual_encoder_train \
                 --rounds "${TOWERS_ROUNDS:-5}" --out "$logs" ;;
    loops)     run_step loops 540 "$py" benchmarks/gpu_levers.py --trace \
                 --models gru_bank,ode_ensemble,inception \
                 --rounds "${LOOPS_ROUNDS:-5}" --out "$logs" ;;
    models)    run_step models 540 "$py" benchmarks/gpu_levers.py --trace \
                 --models "${MODELS_LIST:-models}" \
                 --rounds "${MODELS_ROUNDS:-3}" --out "$logs" ;;
    fixtures)  run_step fixtures 300 "$py" benchmarks/xla_fixtures.py \
                 --out "$logs/fixtures" ;;
    serve)     run_step serve 480 "$py" benchmarks/serve.py --quiet --trace \
                 --rounds "${SERVE_ROUNDS:-4}" --out "$logs" ;;
    overhead)  run_step overhead 120 "$py" benchmarks/jit_overhead.py --part per_call \
                 --out "$logs" ;;
    firstcall) run_step firstcall 360 "$py" benchmarks/jit_overhead.py --part first_call \
                 --models "${FIRSTCALL_MODELS:-suite}" \
                 --rounds "${FIRSTCALL_ROUNDS:-2}" --out "$logs" ;;
    sweep)     run_step sweep 420 "$py" benchmarks/prefetch_sweep.py --quiet \
                 --step-ms 0.1,0.3 --rounds "${SWEEP_ROUNDS:-2}" --out "$logs" ;;
    sweeplong) run_step sweeplong 540 "$py" benchmarks/prefetch_sweep.py \
                 --quiet --step-ms 1,3,10 --rounds "${LONG_ROUNDS:-3}" \
                 --out "$logs" ;;
    prefetch)  run_step prefetch 200 "$py" benchmarks/prefetch.py --out "$logs" ;;
    demo)      run_step demo 120 "$py" examples/streams_demo.py ;;
    *) echo "unknown step: $s (steps: ${all_steps[*]})" >&2; exit 2 ;;
  esac
done
echo "logs in $logs"
