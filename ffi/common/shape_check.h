// Checks shared by handlers that move a buffer unchanged (identity, stage).

#ifndef JAXSTREAMS_FFI_COMMON_SHAPE_CHECK_H_
#define JAXSTREAMS_FFI_COMMON_SHAPE_CHECK_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/errors.h"
#include "xla/ffi/api/ffi.h"

namespace jaxstreams {

// Renders a dtype and dimensions as "dtype=<n>[d0,d1,...]" for messages.
inline std::string DescribeBuffer(const ::xla::ffi::AnyBuffer& b) {
  std::string out = StrCat("dtype=", static_cast<int>(b.element_type()), "[");
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    out += StrCat(i ? "," : "", dims[i]);
  }
  return out + "]";
}

// A copy between two XLA buffers is only correct when both have the same
// element type and byte size; a mismatch means a bad lowering, not bad data.
inline ::xla::ffi::Error CheckSameLayout(const char* where,
                                         const ::xla::ffi::AnyBuffer& in,
                                         const ::xla::ffi::AnyBuffer& out) {
  if (in.element_type() != out.element_type() ||
      in.size_bytes() != out.size_bytes()) {
    return InvalidArgument(where, "operand ", DescribeBuffer(in),
                           " and result ", DescribeBuffer(out),
                           " differ in dtype or size");
  }
  return ::xla::ffi::Error::Success();
}

}  // namespace jaxstreams

#endif  // JAXSTREAMS_FFI_COMMON_SHAPE_CHECK_H_
