// Device kernels of the CUDA runtime. Compiled by nvcc for sm_90 plus a
// compute_90 PTX fallback (see ffi/CMakeLists.txt).

#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/kernels.h"

namespace jaxstreams::cuda {
namespace {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinKernel(int64_t nanoseconds) {
  const uint64_t start = GlobalTimerNs();
  while (static_cast<int64_t>(GlobalTimerNs() - start) < nanoseconds) {
  }
}

}  // namespace

cudaError_t LaunchSpin(cudaStream_t stream, int64_t nanoseconds) {
  if (nanoseconds <= 0) return cudaSuccess;
  SpinKernel<<<1, 1, 0, stream>>>(nanoseconds);
  return cudaGetLastError();
}

}  // namespace jaxstreams::cuda
