// Turns any C++ exception into an error at the library's boundaries.
//
// A C++ exception that reaches the C ABI (a ctypes call, an XLA FFI handler)
// would terminate the process. Every C API function (common/capi_impl.h) and
// every handler (JAXSTREAMS_GUARDED below) catches instead and reports the
// exception's message the way that boundary reports errors.

#ifndef JAXSTREAMS_FFI_COMMON_GUARD_H_
#define JAXSTREAMS_FFI_COMMON_GUARD_H_

#include <exception>
#include <new>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>

#include "common/errors.h"
#include "xla/ffi/api/ffi.h"

namespace jaxstreams {

// Describes the exception being handled; call only inside a catch block.
inline std::string CurrentExceptionMessage(const char* where) {
  try {
    throw;
  } catch (const std::bad_alloc& e) {
    return StrCat("jaxstreams: ", where, ": out of memory (", e.what(), ")");
  } catch (const std::system_error& e) {
    return StrCat("jaxstreams: ", where, ": system error: ", e.what());
  } catch (const std::exception& e) {
    return StrCat("jaxstreams: ", where, ": ", e.what());
  } catch (...) {
    return StrCat("jaxstreams: ", where, ": unknown C++ exception");
  }
}

namespace guard_internal {

// The handler result that reports `error`: the error itself, or for an
// asynchronous handler a future that has already failed with it.
template <typename R>
R Failed(::xla::ffi::Error error) {
  if constexpr (std::is_same_v<R, ::xla::ffi::Future>) {
    ::xla::ffi::Promise promise;
    ::xla::ffi::Future future(promise);
    promise.SetError(std::move(error));
    return future;
  } else {
    return error;
  }
}

template <auto Fn, const char* Where>
struct Guarded;

// Calls the handler function Fn; an exception it throws becomes its error.
template <typename R, typename... Args, R (*Fn)(Args...), const char* Where>
struct Guarded<Fn, Where> {
  static R Call(Args... args) {
    try {
      return Fn(std::move(args)...);
    } catch (...) {
      return Failed<R>(::xla::ffi::Error(::xla::ffi::ErrorCode::kInternal,
                                         CurrentExceptionMessage(Where)));
    }
  }
};

}  // namespace guard_internal
}  // namespace jaxstreams

// Defines the exported handler SYMBOL for FN, as XLA_FFI_DEFINE_HANDLER_SYMBOL
// does, with exceptions from FN turned into its error.
#define JAXSTREAMS_DEFINE_GUARDED_HANDLER(SYMBOL, FN, BINDING)                 \
  namespace {                                                                  \
  constexpr char kWhere##SYMBOL[] = #SYMBOL;                                   \
  }                                                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                               \
      SYMBOL, (::jaxstreams::guard_internal::Guarded<FN, kWhere##SYMBOL>::Call), \
      BINDING)

#endif  // JAXSTREAMS_FFI_COMMON_GUARD_H_
