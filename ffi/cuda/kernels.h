// Host-side launchers for the few device kernels the runtime owns. The
// kernels live in kernels.cu.cc, the only file compiled by nvcc, so the
// handlers stay plain C++.

#ifndef JAXSTREAMS_FFI_CUDA_KERNELS_H_
#define JAXSTREAMS_FFI_CUDA_KERNELS_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxstreams::cuda {

// Keeps one thread of `stream` busy for about `nanoseconds` (measured with the
// device's global timer). Used to inject a slow producer in tests.
cudaError_t LaunchSpin(cudaStream_t stream, int64_t nanoseconds);

}  // namespace jaxstreams::cuda

#endif  // JAXSTREAMS_FFI_CUDA_KERNELS_H_
