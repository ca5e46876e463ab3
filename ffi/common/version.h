// Version of the contract between the native libraries and
// jaxstreams/runtime (handler names, attributes, C API signatures). Bump it
// together with ABI_VERSION in jaxstreams/runtime/_loader.py whenever either
// side changes, so a stale library is reported instead of misbehaving.

#ifndef JAXSTREAMS_FFI_COMMON_VERSION_H_
#define JAXSTREAMS_FFI_COMMON_VERSION_H_

#define JAXSTREAMS_FFI_ABI_VERSION 1

#endif  // JAXSTREAMS_FFI_COMMON_VERSION_H_
