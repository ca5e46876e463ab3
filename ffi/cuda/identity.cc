// jaxstreams_identity on CUDA: a device-to-device copy on the stream XLA
// hands the handler, so it is ordered with the rest of the region.

#include <cuda_runtime_api.h>

#include "common/errors.h"
#include "common/guard.h"
#include "common/shape_check.h"
#include "cuda/cuda_errors.h"
#include "cuda/cuda_handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxstreams {
namespace {

ffi::Error IdentityCuda(cudaStream_t stream, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> y) {
  FFI_RETURN_IF_ERROR(CheckSameLayout("jaxstreams_identity", x, *y));
  if (y->untyped_data() == x.untyped_data() || x.size_bytes() == 0) {
    return ffi::Error::Success();
  }
  JS_CUDA_RETURN_IF_ERROR(
      "jaxstreams_identity",
      cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), x.size_bytes(),
                      cudaMemcpyDeviceToDevice, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxstreams

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsIdentityCuda, jaxstreams::IdentityCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
