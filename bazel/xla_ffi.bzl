"""Repository rule exposing the XLA FFI headers that ship inside jaxlib.

The headers are not on any registry Bazel could fetch offline, and their
version must match the jaxlib that will load the library, so the rule takes
them from the local jaxlib: $XLA_FFI_INCLUDE_DIR when set, otherwise the
directory `jax.ffi.include_dir()` (or jaxlib/include) reports for
$PYTHON_BIN_PATH (default python3).
"""

_FIND = """
import os
try:
    import jax.ffi as f
    print(f.include_dir())
except Exception:
    import jaxlib
    print(os.path.join(os.path.dirname(jaxlib.__file__), "include"))
"""

_BUILD = """
cc_library(
    name = "headers",
    hdrs = glob(["include/xla/ffi/api/*.h"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)
"""

def _xla_ffi_headers_impl(ctx):
    include_dir = ctx.os.environ.get("XLA_FFI_INCLUDE_DIR", "")
    if not include_dir:
        python = ctx.os.environ.get("PYTHON_BIN_PATH", "python3")
        result = ctx.execute([python, "-c", _FIND])
        if result.return_code != 0:
            fail("jaxstreams: could not find the XLA FFI headers with %s " % python +
                 "(install jaxlib or set XLA_FFI_INCLUDE_DIR):\n" + result.stderr)
        include_dir = result.stdout.strip()
    header = ctx.path(include_dir + "/xla/ffi/api/ffi.h")
    if not header.exists:
        fail("jaxstreams: %s does not exist" % header)
    ctx.symlink(include_dir + "/xla", "include/xla")
    ctx.file("BUILD.bazel", _BUILD)
    ctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % ctx.name)

xla_ffi_headers = repository_rule(
    implementation = _xla_ffi_headers_impl,
    environ = ["XLA_FFI_INCLUDE_DIR", "PYTHON_BIN_PATH"],
    local = True,
)
