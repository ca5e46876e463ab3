// The C API of common/capi.h, written once over a per-platform backend.
//
// Each library defines a backend (a struct of static functions, below) and
// expands JAXSTREAMS_DEFINE_CAPI(PREFIX, Backend) once; every exported
// function is a guarded call into the shared logic here, so no C++ exception
// crosses the C ABI: it becomes an error code and a message.
//
// A backend provides:
//   using StageType;                      // has item_bytes, allocations
//   static SlotQueue& Queue(StageType&);
//   static int32_t Device(const StageType&);
//   static Status CreatePool(int64_t device, int64_t streams, int64_t events);
//   static bool PoolInfo(int64_t device, int64_t* streams, int64_t* events);
//   static void DestroyAllPools();
//   static Status Synchronize(int64_t device);
//   static Status CreateStage(int64_t device, int64_t capacity,
//                             int64_t item_bytes, int64_t* id);
//   static std::shared_ptr<StageType> FindStage(int64_t id);
//   static bool DestroyStage(int64_t id);
//   // Copies the host buffers into `slot` and starts its transfer to the
//   // consumer's side; the slot is published only if this succeeds.
//   static Status StartTransfer(std::shared_ptr<StageType> stage, int64_t slot,
//                               int64_t n, const void* const* ptrs,
//                               const int64_t* sizes, int64_t delay_us);
//   static Status TimelineReset(int64_t device, int64_t capacity);
//   static Status TimelineRead(int64_t device, JaxstreamsMarker* out,
//                              int64_t max, int64_t* count, int64_t* dropped);

#ifndef JAXSTREAMS_FFI_COMMON_CAPI_IMPL_H_
#define JAXSTREAMS_FFI_COMMON_CAPI_IMPL_H_

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "common/capi.h"
#include "common/errors.h"
#include "common/guard.h"
#include "common/slot_queue.h"
#include "common/version.h"
#include "xla/ffi/api/c_api.h"

namespace jaxstreams::capi {

// A C API result: a status code and, when it is not OK, the message.
struct Status {
  JaxstreamsStatus code = JAXSTREAMS_OK;
  std::string message;

  static Status Ok() { return {}; }
  bool ok() const { return code == JAXSTREAMS_OK; }
};

inline Status Error(JaxstreamsStatus code, std::string message) {
  return Status{code, std::move(message)};
}

// Writes `message` into a caller's C buffer, always NUL-terminated.
inline void WriteError(const std::string& message, char* err, int64_t errlen) {
  if (err == nullptr || errlen <= 0) return;
  size_t n = std::min<size_t>(message.size(), static_cast<size_t>(errlen - 1));
  std::memcpy(err, message.data(), n);
  err[n] = '\0';
}

// Runs `body` (returning a Status) and reports its failure, or any exception
// it throws, through the caller's error buffer.
template <typename Body>
int Guarded(const char* where, char* err, int64_t errlen, Body&& body) {
  Status status;
  try {
    status = body();
  } catch (...) {
    status = Error(JAXSTREAMS_INTERNAL, CurrentExceptionMessage(where));
  }
  if (!status.ok()) WriteError(status.message, err, errlen);
  return status.code;
}

// For the functions without an error buffer: the code alone.
template <typename Body>
int GuardedCode(const char* where, Body&& body) {
  return Guarded(where, nullptr, 0, std::forward<Body>(body));
}

inline int FfiApiVersion() {
  return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR;
}

// The host buffers of a stage put: none null unless empty, and together
// exactly one item of `item_bytes`.
inline Status CheckPutBuffers(int64_t id, int64_t n, const void* const* ptrs,
                              const int64_t* sizes, int64_t item_bytes) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (sizes[i] < 0 || (sizes[i] > 0 && ptrs[i] == nullptr)) {
      return Error(JAXSTREAMS_INVALID_ARGUMENT,
                   StrCat("jaxstreams: stage ", id, " put: buffer ", i,
                          " is null or has a negative size"));
    }
    total += sizes[i];
  }
  if (total != item_bytes) {
    return Error(JAXSTREAMS_INVALID_ARGUMENT,
                 StrCat("jaxstreams: stage ", id, " holds items of ", item_bytes,
                        " bytes, the put has ", total, " bytes"));
  }
  return Status::Ok();
}

template <typename B>
Status StagePut(int64_t id, int64_t n, const void* const* ptrs,
                const int64_t* sizes, int64_t timeout_ms, int64_t delay_us) {
  std::shared_ptr<typename B::StageType> stage = B::FindStage(id);
  if (!stage) {
    return Error(JAXSTREAMS_NOT_FOUND, StrCat("jaxstreams: no stage with id ", id));
  }
  if (Status status = CheckPutBuffers(id, n, ptrs, sizes, stage->item_bytes);
      !status.ok()) {
    return status;
  }
  SlotQueue& queue = B::Queue(*stage);
  int64_t slot = -1;
  switch (queue.AcquireFree(timeout_ms, &slot)) {
    case SlotWait::kOk:
      break;
    case SlotWait::kTimeout:
      return Error(JAXSTREAMS_TIMEOUT,
                   StrCat("jaxstreams: stage ", id, " is full: all ",
                          queue.capacity(),
                          " slots hold items no consumer has taken (waited ",
                          timeout_ms, " ms)"));
    case SlotWait::kClosed:
      return Error(JAXSTREAMS_CLOSED, StrCat("jaxstreams: stage ", id, " is closed"));
  }
  Status status;
  try {
    status = B::StartTransfer(stage, slot, n, ptrs, sizes, delay_us);
  } catch (...) {
    queue.ReturnFree(slot);
    throw;
  }
  if (!status.ok()) {
    queue.ReturnFree(slot);
    return status;
  }
  queue.Publish(slot);
  return Status::Ok();
}

template <typename B>
Status StageStats(int64_t id, JaxstreamsStageStats* out) {
  std::shared_ptr<typename B::StageType> stage = B::FindStage(id);
  if (!stage) return Error(JAXSTREAMS_NOT_FOUND, "");
  SlotQueue& queue = B::Queue(*stage);
  auto c = queue.counters();
  out->capacity = queue.capacity();
  out->item_bytes = stage->item_bytes;
  out->puts = c.puts;
  out->gets = c.gets;
  out->queued = c.queued;
  out->free_slots = c.free_slots;
  out->allocations = stage->allocations;
  out->last_slot = c.last_slot;
  out->closed = c.closed ? 1 : 0;
  out->device = B::Device(*stage);
  return Status::Ok();
}

template <typename B>
Status StageClose(int64_t id) {
  std::shared_ptr<typename B::StageType> stage = B::FindStage(id);
  if (!stage) return Error(JAXSTREAMS_NOT_FOUND, "");
  B::Queue(*stage).Close();
  return Status::Ok();
}

template <typename B>
Status TimelineReset(int64_t device, int64_t capacity) {
  if (capacity < 0) {
    return Error(JAXSTREAMS_INVALID_ARGUMENT,
                 StrCat("jaxstreams: timeline capacity must be >= 0, got ",
                        capacity));
  }
  return B::TimelineReset(device, capacity);
}

}  // namespace jaxstreams::capi

// Defines every function of JAXSTREAMS_DECLARE_CAPI(PREFIX) over `Backend`.
#define JAXSTREAMS_DEFINE_CAPI(PREFIX, Backend)                                \
  JAXSTREAMS_DECLARE_CAPI(PREFIX)                                              \
  int PREFIX##AbiVersion(void) { return JAXSTREAMS_FFI_ABI_VERSION; }          \
  int PREFIX##FfiApiVersion(void) {                                            \
    return ::jaxstreams::capi::FfiApiVersion();                                \
  }                                                                            \
  int PREFIX##PoolCreate(int64_t device, int64_t streams, int64_t events,      \
                         char* err, int64_t errlen) {                          \
    return ::jaxstreams::capi::Guarded(#PREFIX "PoolCreate", err, errlen, [&] { \
      return Backend::CreatePool(device, streams, events);                     \
    });                                                                        \
  }                                                                            \
  int PREFIX##PoolInfo(int64_t device, int64_t* streams, int64_t* events) {    \
    try {                                                                      \
      return Backend::PoolInfo(device, streams, events) ? 1 : 0;               \
    } catch (...) {                                                            \
      return 0;                                                                \
    }                                                                          \
  }                                                                            \
  void PREFIX##PoolDestroyAll(void) {                                          \
    ::jaxstreams::capi::GuardedCode(#PREFIX "PoolDestroyAll", [] {             \
      Backend::DestroyAllPools();                                              \
      return ::jaxstreams::capi::Status::Ok();                                 \
    });                                                                        \
  }                                                                            \
  int PREFIX##Synchronize(int64_t device, char* err, int64_t errlen) {         \
    return ::jaxstreams::capi::Guarded(#PREFIX "Synchronize", err, errlen,     \
                                       [&] { return Backend::Synchronize(device); }); \
  }                                                                            \
  int PREFIX##StageCreate(int64_t device, int64_t capacity,                    \
                          int64_t item_bytes, int64_t* id, char* err,          \
                          int64_t errlen) {                                    \
    return ::jaxstreams::capi::Guarded(#PREFIX "StageCreate", err, errlen, [&] { \
      return Backend::CreateStage(device, capacity, item_bytes, id);           \
    });                                                                        \
  }                                                                            \
  int PREFIX##StagePut(int64_t id, int64_t n, const void* const* ptrs,         \
                       const int64_t* sizes, int64_t timeout_ms,               \
                       int64_t delay_us, char* err, int64_t errlen) {          \
    return ::jaxstreams::capi::Guarded(#PREFIX "StagePut", err, errlen, [&] {  \
      return ::jaxstreams::capi::StagePut<Backend>(id, n, ptrs, sizes,         \
                                                   timeout_ms, delay_us);      \
    });                                                                        \
  }                                                                            \
  int PREFIX##StageClose(int64_t id) {                                         \
    return ::jaxstreams::capi::GuardedCode(                                    \
        #PREFIX "StageClose",                                                  \
        [&] { return ::jaxstreams::capi::StageClose<Backend>(id); });          \
  }                                                                            \
  int PREFIX##StageDestroy(int64_t id) {                                       \
    return ::jaxstreams::capi::GuardedCode(#PREFIX "StageDestroy", [&] {       \
      return Backend::DestroyStage(id)                                         \
                 ? ::jaxstreams::capi::Status::Ok()                            \
                 : ::jaxstreams::capi::Error(JAXSTREAMS_NOT_FOUND, "");        \
    });                                                                        \
  }                                                                            \
  int PREFIX##StageStats(int64_t id, JaxstreamsStageStats* out) {              \
    return ::jaxstreams::capi::GuardedCode(                                    \
        #PREFIX "StageStats",                                                  \
        [&] { return ::jaxstreams::capi::StageStats<Backend>(id, out); });     \
  }                                                                            \
  int PREFIX##TimelineReset(int64_t device, int64_t capacity, char* err,       \
                            int64_t errlen) {                                  \
    return ::jaxstreams::capi::Guarded(#PREFIX "TimelineReset", err, errlen, [&] { \
      return ::jaxstreams::capi::TimelineReset<Backend>(device, capacity);     \
    });                                                                        \
  }                                                                            \
  int PREFIX##TimelineRead(int64_t device, JaxstreamsMarker* out, int64_t max, \
                           int64_t* count, int64_t* dropped, char* err,        \
                           int64_t errlen) {                                   \
    return ::jaxstreams::capi::Guarded(#PREFIX "TimelineRead", err, errlen, [&] { \
      return Backend::TimelineRead(device, out, max, count, dropped);          \
    });                                                                        \
  }

#endif  // JAXSTREAMS_FFI_COMMON_CAPI_IMPL_H_
