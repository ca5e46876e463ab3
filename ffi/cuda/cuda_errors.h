// Turns CUDA runtime errors into ffi::Error values instead of aborting.

#ifndef JAXSTREAMS_FFI_CUDA_CUDA_ERRORS_H_
#define JAXSTREAMS_FFI_CUDA_CUDA_ERRORS_H_

#include <cuda_runtime_api.h>

#include "common/errors.h"
#include "xla/ffi/api/ffi.h"

namespace jaxstreams {

// Builds "jaxstreams: <where>: <expr> failed: <cuda error name>: <text>
// (file:line)". The message names the call so the user can tell a missing
// device from an out-of-memory from a bad launch.
inline ::xla::ffi::Error CudaError(cudaError_t err, const char* where,
                                   const char* expr, const char* file,
                                   int line) {
  return MakeError(::xla::ffi::ErrorCode::kInternal, where, expr, " failed: ",
                   cudaGetErrorName(err), ": ", cudaGetErrorString(err), " (",
                   file, ":", line, ")");
}

}  // namespace jaxstreams

// Evaluates a CUDA runtime call; on failure resets the runtime's last-error
// slot (so the next call does not report it again) and returns an ffi::Error
// naming `where` (usually the handler name).
#define JS_CUDA_RETURN_IF_ERROR(where, expr)                                  \
  do {                                                                        \
    cudaError_t jaxstreams_cuda_err_ = (expr);                                \
    if (XLA_FFI_PREDICT_FALSE(jaxstreams_cuda_err_ != cudaSuccess)) {         \
      (void)cudaGetLastError();                                               \
      return ::jaxstreams::CudaError(jaxstreams_cuda_err_, where, #expr,      \
                                     __FILE__, __LINE__);                     \
    }                                                                         \
  } while (0)

#endif  // JAXSTREAMS_FFI_CUDA_CUDA_ERRORS_H_
