// jaxstreams_identity on CPU: the smallest handler that proves the build,
// load and registration chain end to end.

#include <cstring>

#include "common/errors.h"
#include "common/guard.h"
#include "common/shape_check.h"
#include "cpu/cpu_handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxstreams {
namespace {

ffi::Error IdentityCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  FFI_RETURN_IF_ERROR(CheckSameLayout("jaxstreams_identity", x, *y));
  // When XLA aliases the result to the operand there is nothing to copy.
  if (y->untyped_data() != x.untyped_data() && x.size_bytes() > 0) {
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxstreams

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsIdentityCpu, jaxstreams::IdentityCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
