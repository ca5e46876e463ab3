"""Offline stand-in for @rules_cc//cc:defs.bzl.

Bazel 4's own @bazel_tools loads these names from @rules_cc, which it would
otherwise download from GitHub. In Bazel 4 every one of them is still a native
rule, so forwarding to `native` gives exactly the built-in behaviour. Used
through --override_repository=rules_cc=bazel/rules_cc.
"""

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_import(**kwargs):
    native.cc_import(**kwargs)

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_proto_library(**kwargs):
    native.cc_proto_library(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)

def objc_library(**kwargs):
    native.objc_library(**kwargs)
