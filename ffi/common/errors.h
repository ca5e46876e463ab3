// Error plumbing shared by the CPU and CUDA handlers.
//
// Every handler reports failure by returning an `xla::ffi::Error`; XLA turns it
// into a runtime error that Python raises as an exception. Nothing in the
// runtime aborts the process, so these macros are the only way a failure
// leaves a function.

#ifndef JAXSTREAMS_FFI_COMMON_ERRORS_H_
#define JAXSTREAMS_FFI_COMMON_ERRORS_H_

#include <sstream>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

// Handler symbols are looked up by name with dlsym/ctypes, so they must stay
// visible even when the rest of the library is built with hidden visibility.
#if defined(__GNUC__) || defined(__clang__)
#define JAXSTREAMS_EXPORT __attribute__((visibility("default")))
#define JAXSTREAMS_VISIBILITY_PUSH_DEFAULT \
  _Pragma("GCC visibility push(default)")
#define JAXSTREAMS_VISIBILITY_POP _Pragma("GCC visibility pop")
#else
#define JAXSTREAMS_EXPORT
#define JAXSTREAMS_VISIBILITY_PUSH_DEFAULT
#define JAXSTREAMS_VISIBILITY_POP
#endif

#define JAXSTREAMS_CONCAT_INNER(a, b) a##b
#define JAXSTREAMS_CONCAT(a, b) JAXSTREAMS_CONCAT_INNER(a, b)

// Returns the error from the enclosing function if `expr` (an ffi::Error) is
// not a success.
#define FFI_RETURN_IF_ERROR(expr)                                         \
  do {                                                                    \
    ::xla::ffi::Error jaxstreams_status_ = (expr);                        \
    if (XLA_FFI_PREDICT_FALSE(!jaxstreams_status_.success())) {           \
      return jaxstreams_status_;                                          \
    }                                                                     \
  } while (0)

// `lhs = value of rexpr` where rexpr is an ffi::ErrorOr<T>; returns its error
// from the enclosing function otherwise.
#define FFI_ASSIGN_OR_RETURN(lhs, rexpr) \
  FFI_ASSIGN_OR_RETURN_IMPL(JAXSTREAMS_CONCAT(jaxstreams_or_, __LINE__), lhs, rexpr)
#define FFI_ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                              \
  if (XLA_FFI_PREDICT_FALSE(tmp.has_error())) {    \
    return tmp.error();                            \
  }                                                \
  lhs = std::move(tmp.value())

namespace jaxstreams {

// Concatenates its arguments with operator<< into one message string.
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// Every message starts with "jaxstreams: <handler>: " so that a user who sees
// it in a Python traceback knows which part of the runtime failed.
template <typename... Args>
::xla::ffi::Error MakeError(::xla::ffi::ErrorCode code, const char* where,
                            const Args&... args) {
  return ::xla::ffi::Error(code, StrCat("jaxstreams: ", where, ": ", args...));
}

template <typename... Args>
::xla::ffi::Error InvalidArgument(const char* where, const Args&... args) {
  return MakeError(::xla::ffi::ErrorCode::kInvalidArgument, where, args...);
}

template <typename... Args>
::xla::ffi::Error Internal(const char* where, const Args&... args) {
  return MakeError(::xla::ffi::ErrorCode::kInternal, where, args...);
}

}  // namespace jaxstreams

#endif  // JAXSTREAMS_FFI_COMMON_ERRORS_H_
