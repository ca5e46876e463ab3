"""Repository rule exposing the local CUDA toolkit to the Bazel build.

Offline and non-hermetic on purpose: it points at the toolkit that CMake
would use ($CUDA_PATH, default /usr/local/cuda) and exports the CUDA runtime
headers, the static CUDA runtime and the path of nvcc (for the genrule that
compiles ffi/cuda/*.cu.cc). Only fetched when a CUDA target is built.
"""

_BUILD = """
cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/*.h", "include/crt/*.h", "include/crt/*.hpp"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)

# The static runtime, as in CMake: the library then loads wherever only the
# driver is installed.
cc_library(
    name = "cudart_static",
    srcs = ["lib/libcudart_static.a"],
    linkopts = ["-ldl", "-lrt", "-lpthread"],
    visibility = ["//visibility:public"],
)
"""

# Without a toolkit the repository still loads (BUILD.bazel loads NVCC for
# every target), but building a CUDA target fails with this message.
_MISSING_BUILD = """
cc_library(name = "cuda_headers", visibility = ["//visibility:public"])
cc_library(name = "cudart_static", visibility = ["//visibility:public"])
"""

def _cuda_toolkit_impl(ctx):
    cuda_path = ctx.os.environ.get("CUDA_PATH", "") or "/usr/local/cuda"
    nvcc = ctx.path(cuda_path + "/bin/nvcc")
    ctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % ctx.name)
    if not nvcc.exists:
        ctx.file("BUILD.bazel", _MISSING_BUILD)
        ctx.file("defs.bzl", "NVCC = %r\n" % (
            "echo 'jaxstreams: no nvcc at %s; set CUDA_PATH to a CUDA toolkit' >&2; exit 1;" % nvcc))
        return
    ctx.symlink(cuda_path + "/include", "include")
    lib = ctx.path(cuda_path + "/lib64/libcudart_static.a")
    if not lib.exists:
        lib = ctx.path(cuda_path + "/lib/libcudart_static.a")
    ctx.symlink(lib, "lib/libcudart_static.a")
    ctx.file("BUILD.bazel", _BUILD)
    ctx.file("defs.bzl", "NVCC = %r\n" % str(nvcc))

cuda_toolkit = repository_rule(
    implementation = _cuda_toolkit_impl,
    environ = ["CUDA_PATH"],
    local = True,
)
