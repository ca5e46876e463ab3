// Pass-through operands: the ordering handlers (record, wait, delay, marker)
// return their operands unchanged so that data dependencies keep them in
// place in the program. When XLA did not alias a result to its operand, the
// platform copies it (`copy(dst, src, bytes)`).

#ifndef JAXSTREAMS_FFI_COMMON_PASSTHROUGH_H_
#define JAXSTREAMS_FFI_COMMON_PASSTHROUGH_H_

#include <cstddef>

#include "common/errors.h"
#include "common/shape_check.h"
#include "xla/ffi/api/ffi.h"

namespace jaxstreams {

template <typename CopyFn>
::xla::ffi::Error PassThrough(const char* where,
                              const ::xla::ffi::RemainingArgs& args,
                              const ::xla::ffi::RemainingRets& rets,
                              CopyFn&& copy) {
  if (args.size() != rets.size()) {
    return InvalidArgument(where, "has ", args.size(), " operands but ",
                           rets.size(), " results; they must pair up");
  }
  for (size_t i = 0; i < args.size(); ++i) {
    FFI_ASSIGN_OR_RETURN(auto in, args.get<::xla::ffi::AnyBuffer>(i));
    FFI_ASSIGN_OR_RETURN(auto out, rets.get<::xla::ffi::AnyBuffer>(i));
    FFI_RETURN_IF_ERROR(CheckSameLayout(where, in, *out));
    if (out->untyped_data() != in.untyped_data() && in.size_bytes() > 0) {
      FFI_RETURN_IF_ERROR(
          copy(out->untyped_data(), in.untyped_data(), in.size_bytes()));
    }
  }
  return ::xla::ffi::Error::Success();
}

// Sum of the byte sizes of `rets`, which a stage item must match.
inline ::xla::ffi::ErrorOr<size_t> TotalBytes(
    const ::xla::ffi::RemainingRets& rets) {
  size_t total = 0;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto out = rets.get<::xla::ffi::AnyBuffer>(i);
    if (out.has_error()) return ::xla::ffi::Unexpected(out.error());
    total += (*out)->size_bytes();
  }
  return total;
}

}  // namespace jaxstreams

#endif  // JAXSTREAMS_FFI_COMMON_PASSTHROUGH_H_
