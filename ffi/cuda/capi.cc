// The C API of the CUDA library (see common/capi.h), called from Python with
// ctypes: pools, stages (the producer side: host -> pinned -> device on the
// copy stream) and the marker log.

#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include <cuda_runtime_api.h>

#include "common/capi.h"
#include "common/errors.h"
#include "common/version.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "xla/ffi/api/c_api.h"

using jaxstreams::Fail;
using jaxstreams::StrCat;
using jaxstreams::cuda::DeviceGuard;
using jaxstreams::cuda::Pool;
using jaxstreams::cuda::Runtime;
using jaxstreams::cuda::Stage;

JAXSTREAMS_DECLARE_CAPI(JaxstreamsCuda)

namespace {

int CudaFail(const char* what, cudaError_t err, char* buf, int64_t errlen) {
  (void)cudaGetLastError();
  return Fail(JAXSTREAMS_INTERNAL,
              StrCat("jaxstreams: ", what, " failed: ", cudaGetErrorName(err),
                     ": ", cudaGetErrorString(err)),
              buf, errlen);
}

#define JS_CAPI_CUDA(what, expr)                                  \
  do {                                                            \
    cudaError_t jaxstreams_err_ = (expr);                         \
    if (jaxstreams_err_ != cudaSuccess) {                         \
      return CudaFail(what, jaxstreams_err_, err, errlen);        \
    }                                                             \
  } while (0)

int NoPool(int64_t device, char* err, int64_t errlen) {
  return Fail(JAXSTREAMS_NOT_FOUND,
              StrCat("jaxstreams: no CUDA pool for device ", device,
                     "; call jaxstreams.runtime.init() first"),
              err, errlen);
}

}  // namespace

int JaxstreamsCudaAbiVersion(void) { return JAXSTREAMS_FFI_ABI_VERSION; }

// The XLA FFI API version of the headers this library was compiled against,
// major * 1000 + minor: the loader compares it with the running jaxlib's
// before registering any handler (jaxlib refuses handlers newer than itself).
extern "C" JAXSTREAMS_EXPORT int JaxstreamsCudaFfiApiVersion(void) {
  return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR;
}

int JaxstreamsCudaPoolCreate(int64_t device, int64_t streams, int64_t events,
                             char* err, int64_t errlen) {
  std::string message;
  JaxstreamsStatus status =
      Runtime::Get().CreatePool(device, streams, events, &message);
  if (status != JAXSTREAMS_OK) return Fail(status, message, err, errlen);
  return JAXSTREAMS_OK;
}

int JaxstreamsCudaPoolInfo(int64_t device, int64_t* streams, int64_t* events) {
  Pool* pool = Runtime::Get().FindPool(device);
  if (pool == nullptr) return 0;
  *streams = static_cast<int64_t>(pool->streams.size());
  *events = static_cast<int64_t>(pool->events.size());
  return 1;
}

void JaxstreamsCudaPoolDestroyAll(void) { Runtime::Get().DestroyAllPools(); }

int JaxstreamsCudaSynchronize(int64_t device, char* err, int64_t errlen) {
  Pool* pool = Runtime::Get().FindPool(device);
  if (pool == nullptr) return NoPool(device, err, errlen);
  DeviceGuard guard(pool->device);
  for (cudaStream_t s : pool->streams) {
    JS_CAPI_CUDA("cudaStreamSynchronize(runtime stream)", cudaStreamSynchronize(s));
  }
  JS_CAPI_CUDA("cudaStreamSynchronize(copy stream)",
               cudaStreamSynchronize(pool->copy));
  return JAXSTREAMS_OK;
}

int JaxstreamsCudaStageCreate(int64_t device, int64_t capacity,
                              int64_t item_bytes, int64_t* id, char* err,
                              int64_t errlen) {
  std::string message;
  JaxstreamsStatus status =
      Runtime::Get().CreateStage(device, capacity, item_bytes, id, &message);
  if (status != JAXSTREAMS_OK) return Fail(status, message, err, errlen);
  return JAXSTREAMS_OK;
}

int JaxstreamsCudaStagePut(int64_t id, int64_t n, const void* const* ptrs,
                           const int64_t* sizes, int64_t timeout_ms,
                           int64_t delay_us, char* err, int64_t errlen) {
  std::shared_ptr<Stage> stage = Runtime::Get().FindStage(id);
  if (!stage) {
    return Fail(JAXSTREAMS_NOT_FOUND,
                StrCat("jaxstreams: no CUDA stage with id ", id), err, errlen);
  }
  if (int status = jaxstreams::CheckPutBuffers(id, n, ptrs, sizes,
                                               stage->item_bytes, err,
                                               errlen);
      status != JAXSTREAMS_OK) {
    return status;
  }
  int64_t slot = -1;
  switch (stage->queue->AcquireFree(timeout_ms, &slot)) {
    case jaxstreams::SlotWait::kOk:
      break;
    case jaxstreams::SlotWait::kTimeout:
      return Fail(JAXSTREAMS_TIMEOUT,
                  StrCat("jaxstreams: stage ", id, " is full: all ",
                         stage->queue->capacity(),
                         " slots hold items no consumer has taken (waited ",
                         timeout_ms, " ms)"),
                  err, errlen);
    case jaxstreams::SlotWait::kClosed:
      return Fail(JAXSTREAMS_CLOSED, StrCat("jaxstreams: stage ", id, " is closed"),
                  err, errlen);
  }
  int status = [&]() -> int {
    DeviceGuard guard(stage->device);
    JS_CAPI_CUDA("cudaSetDevice", guard.status());
    // The previous transfer out of this pinned slot must have finished before
    // the host overwrites it (usually long done: the slot was consumed).
    JS_CAPI_CUDA("cudaEventSynchronize(slot ready)",
                 cudaEventSynchronize(stage->ready[slot]));
    char* dst = stage->pinned_slot(slot);
    for (int64_t i = 0; i < n; ++i) {
      if (sizes[i] > 0) std::memcpy(dst, ptrs[i], static_cast<size_t>(sizes[i]));
      dst += sizes[i];
    }
    // The consumer's copy out of the device slot must be done before the
    // copy stream overwrites it; then the transfer, then "ready".
    JS_CAPI_CUDA("cudaStreamWaitEvent(copy stream, slot consumed)",
                 cudaStreamWaitEvent(stage->copy, stage->consumed[slot], 0));
    if (delay_us > 0) {
      JS_CAPI_CUDA("spin kernel on the copy stream",
                   jaxstreams::cuda::LaunchSpin(stage->copy, delay_us * 1000));
    }
    JS_CAPI_CUDA("cudaMemcpyAsync(host to device slot)",
                 cudaMemcpyAsync(stage->device_slot(slot), stage->pinned_slot(slot),
                                 static_cast<size_t>(stage->item_bytes),
                                 cudaMemcpyHostToDevice, stage->copy));
    JS_CAPI_CUDA("cudaEventRecord(slot ready)",
                 cudaEventRecord(stage->ready[slot], stage->copy));
    return JAXSTREAMS_OK;
  }();
  if (status != JAXSTREAMS_OK) {
    stage->queue->ReturnFree(slot);
    return status;
  }
  stage->queue->Publish(slot);
  return JAXSTREAMS_OK;
}

int JaxstreamsCudaStageClose(int64_t id) {
  std::shared_ptr<Stage> stage = Runtime::Get().FindStage(id);
  if (!stage) return JAXSTREAMS_NOT_FOUND;
  stage->queue->Close();
  return JAXSTREAMS_OK;
}

int JaxstreamsCudaStageDestroy(int64_t id) {
  return Runtime::Get().DestroyStage(id) ? JAXSTREAMS_OK : JAXSTREAMS_NOT_FOUND;
}

int JaxstreamsCudaStageStats(int64_t id, JaxstreamsStageStats* out) {
  std::shared_ptr<Stage> stage = Runtime::Get().FindStage(id);
  if (!stage) return JAXSTREAMS_NOT_FOUND;
  auto c = stage->queue->counters();
  out->capacity = stage->queue->capacity();
  out->item_bytes = stage->item_bytes;
  out->puts = c.puts;
  out->gets = c.gets;
  out->queued = c.queued;
  out->free_slots = c.free_slots;
  out->allocations = stage->allocations;
  out->last_slot = c.last_slot;
  out->closed = c.closed ? 1 : 0;
  out->device = stage->device;
  return JAXSTREAMS_OK;
}

int JaxstreamsCudaTimelineReset(int64_t device, int64_t capacity, char* err,
                                int64_t errlen) {
  Pool* pool = Runtime::Get().FindPool(device);
  if (pool == nullptr) return NoPool(device, err, errlen);
  if (capacity < 0) {
    return Fail(JAXSTREAMS_INVALID_ARGUMENT,
                StrCat("jaxstreams: timeline capacity must be >= 0, got ", capacity),
                err, errlen);
  }
  DeviceGuard guard(pool->device);
  JS_CAPI_CUDA("cudaSetDevice", guard.status());
  // Markers of the previous session may still be pending on some stream.
  for (cudaEvent_t e : pool->timing_events) {
    JS_CAPI_CUDA("cudaEventSynchronize(marker)", cudaEventSynchronize(e));
  }
  pool->markers.Reset(0);
  if (static_cast<int64_t>(pool->timing_events.size()) != capacity) {
    for (cudaEvent_t e : pool->timing_events) cudaEventDestroy(e);
    pool->timing_events.clear();
    for (int64_t i = 0; i < capacity; ++i) {
      cudaEvent_t e = nullptr;
      JS_CAPI_CUDA("cudaEventCreate(marker)", cudaEventCreate(&e));
      pool->timing_events.push_back(e);
    }
  }
  pool->markers.Reset(capacity);
  return JAXSTREAMS_OK;
}

int JaxstreamsCudaTimelineRead(int64_t device, JaxstreamsMarker* out,
                               int64_t max, int64_t* count, int64_t* dropped,
                               char* err, int64_t errlen) {
  Pool* pool = Runtime::Get().FindPool(device);
  if (pool == nullptr) return NoPool(device, err, errlen);
  DeviceGuard guard(pool->device);
  JS_CAPI_CUDA("cudaSetDevice", guard.status());
  int64_t n = std::min(pool->markers.size(), max);
  for (int64_t i = 0; i < n; ++i) {
    JS_CAPI_CUDA("cudaEventSynchronize(marker)",
                 cudaEventSynchronize(pool->timing_events[i]));
    float ms = 0.0f;
    JS_CAPI_CUDA("cudaEventElapsedTime",
                 cudaEventElapsedTime(&ms, pool->timing_events[0],
                                      pool->timing_events[i]));
    out[i] = pool->markers.at(i);
    out[i].t_ns = static_cast<int64_t>(std::llround(static_cast<double>(ms) * 1e6));
  }
  *count = n;
  *dropped = pool->markers.dropped();
  return JAXSTREAMS_OK;
}
