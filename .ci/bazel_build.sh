#!/usr/bin/env bash
# Builds the native runtime with Bazel (BUILD.bazel) and checks the result:
# libjaxstreams_cpu.so always, libjaxstreams_cuda.so when a CUDA toolkit is
# found. Each library must export every handler and C API symbol the Python
# loader registers; when jaxstreams is importable, the CPU library is then
# loaded into jax and run.
#
# Offline: Bazel is Debian's bazel-bootstrap (4.2.3, installed here if
# missing); the XLA FFI headers come from the installed jaxlib; @rules_cc and
# @rules_java are the local forwarding repositories in bazel/.
#
# Env: PYTHON (interpreter with jax/jaxlib, default python, else python3),
#      XLA_FFI_INCLUDE_DIR (skip asking Python for the headers),
#      CUDA_PATH (CUDA toolkit, default /usr/local/cuda),
#      JAXSTREAMS_BUILD_CUDA=OFF (skip the CUDA library),
#      JAXSTREAMS_BAZEL_KEEP_SERVER=1 (leave the Bazel server running).
set -euo pipefail

# A relative PYTHON (e.g. .venv/bin/python) is relative to the caller's
# directory; keep it usable after the cd below and in the smoke test's cd.
case "${PYTHON:-}" in
  /* | "") ;;
  */*) PYTHON="$PWD/$PYTHON" ;;
esac
cd "$(dirname "$0")/.."
root=$PWD
start=$(date +%s)

if ! command -v bazel >/dev/null 2>&1; then
  echo "bazel_build: installing Debian's bazel-bootstrap"
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq bazel-bootstrap >/dev/null
fi

if [ -z "${PYTHON:-}" ]; then
  if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
if [ -z "${XLA_FFI_INCLUDE_DIR:-}" ]; then
  XLA_FFI_INCLUDE_DIR=$("$PYTHON" -c 'import jax.ffi; print(jax.ffi.include_dir())')
fi
echo "bazel_build: $(bazel --version 2>/dev/null || echo bazel), XLA FFI headers: $XLA_FFI_INCLUDE_DIR"

flags=(
  "--override_repository=rules_cc=$root/bazel/rules_cc"
  "--override_repository=rules_java=$root/bazel/rules_java"
  "--repo_env=XLA_FFI_INCLUDE_DIR=$XLA_FFI_INCLUDE_DIR"
)

cleanup() {
  if [ "${JAXSTREAMS_BAZEL_KEEP_SERVER:-0}" != 1 ]; then
    bazel shutdown >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

cuda_path=${CUDA_PATH:-/usr/local/cuda}
flags+=("--repo_env=CUDA_PATH=$cuda_path")
targets=(//:jaxstreams_cpu)
platforms=(cpu)
case "${JAXSTREAMS_BUILD_CUDA:-ON}" in
  OFF|off|0|false|FALSE) echo "bazel_build: JAXSTREAMS_BUILD_CUDA=OFF, CPU library only" ;;
  *)
    if [ -x "$cuda_path/bin/nvcc" ]; then
      targets+=(//:jaxstreams_cuda)
      platforms+=(cuda)
    else
      echo "bazel_build: no nvcc at $cuda_path/bin, CPU library only"
    fi
    ;;
esac

bazel build "${flags[@]}" "${targets[@]}"
bin=$(bazel info "${flags[@]}" bazel-bin 2>/dev/null)

# Every handler and C API symbol the Python loader needs, read from
# jaxstreams/runtime/_loader.py itself so the two cannot drift apart.
expected_symbols() {
  "$PYTHON" - "$1" <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("jaxstreams_loader", "jaxstreams/runtime/_loader.py")
loader = sys.modules["jaxstreams_loader"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loader)
platform = sys.argv[1]
names = [t[platform] for t in loader.TARGETS.values()]
names += [loader._PLATFORMS[platform][2] + f for f in loader.CAPI_FUNCTIONS]
print(" ".join(sorted(names)))
PY
}

lib_dir=$(mktemp -d)
for platform in "${platforms[@]}"; do
  so="$bin/libjaxstreams_$platform.so"
  if [ ! -f "$so" ]; then
    echo "bazel_build: FAIL: $so was not built" >&2
    exit 1
  fi
  symbols=$(expected_symbols "$platform")
  exported=$(nm -D --defined-only "$so" | awk '$2 == "T" {print $3}')
  missing=0
  for sym in $symbols; do
    if ! grep -qx "$sym" <<<"$exported"; then
      echo "bazel_build: FAIL: $so does not export $sym" >&2
      missing=1
    fi
  done
  if [ "$missing" != 0 ]; then exit 1; fi
  echo "bazel_build: $so exports all $(wc -w <<<"$symbols") expected symbols"
  cp "$so" "$lib_dir/"
done

# Smoke test: the Bazel-built libraries load and register, and the CPU one
# runs handlers under jax.jit (a CUDA program is lowered, not run: no GPU
# is assumed here).
if (cd /tmp && "$PYTHON" -c 'import jaxstreams.runtime' >/dev/null 2>&1); then
  (cd /tmp && JAXSTREAMS_FFI_LIB_DIR="$lib_dir" JAX_PLATFORMS=cpu "$PYTHON" - "${platforms[@]}" <<'PY'
import sys
import jax, jax.numpy as jnp, numpy as np
import jaxstreams.runtime as rt
assert rt.available_platforms() == tuple(sys.argv[1:]), rt.available_platforms()
x = np.arange(10, dtype=np.float32)
np.testing.assert_array_equal(jax.jit(rt.identity)(x), x)
e = rt.allocate_event()
f = jax.jit(lambda v: rt.wait(rt.record(rt.delay(v, microseconds=1000, stream=1),
                                        event=e, stream=1), event=e))
np.testing.assert_array_equal(f(x), x)
with rt.StageArea(jax.ShapeDtypeStruct((10,), jnp.float32), capacity=2, platform="cpu") as s:
    s.put(x)
    np.testing.assert_array_equal(jax.jit(lambda: s.get())(), x)
if "cuda" in rt.available_platforms():
    text = jax.jit(rt.identity).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @jaxstreams_identity" in text
print("bazel_build: the Bazel libraries registered and ran under jax.jit:", rt.available_platforms())
PY
  )
else
  echo "bazel_build: jaxstreams is not installed for $PYTHON; skipped the jax.jit smoke test"
fi
rm -rf "$lib_dir"
echo "bazel_build: OK in $(( $(date +%s) - start )) s"
