"""Offline stand-in for @rules_java//java:defs.bzl.

@bazel_tools loads these names while setting up its toolchains even for a
C++-only build; in Bazel 4 they are native rules, so this forwards to them
instead of downloading rules_java. Used through
--override_repository=rules_java=bazel/rules_java.
"""

def java_binary(**kwargs):
    native.java_binary(**kwargs)

def java_import(**kwargs):
    native.java_import(**kwargs)

def java_library(**kwargs):
    native.java_library(**kwargs)

def java_proto_library(**kwargs):
    native.java_proto_library(**kwargs)

def java_runtime(**kwargs):
    native.java_runtime(**kwargs)

def java_test(**kwargs):
    native.java_test(**kwargs)

def java_toolchain(**kwargs):
    native.java_toolchain(**kwargs)
