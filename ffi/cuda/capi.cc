// The CUDA backend of the C API (common/capi_impl.h): pools, stages (the
// producer side: host -> pinned -> device on the copy stream) and the marker
// log.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include <cuda_runtime_api.h>

#include "common/capi_impl.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"

namespace jaxstreams::cuda {
namespace {

using capi::Status;

Status CudaFailure(const char* what, cudaError_t err) {
  (void)cudaGetLastError();
  return capi::Error(JAXSTREAMS_INTERNAL,
                     StrCat("jaxstreams: ", what, " failed: ",
                            cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

#define JS_CAPI_CUDA(what, expr)                                  \
  do {                                                            \
    cudaError_t jaxstreams_err_ = (expr);                         \
    if (jaxstreams_err_ != cudaSuccess) {                         \
      return CudaFailure(what, jaxstreams_err_);                  \
    }                                                             \
  } while (0)

Status NoPool(int64_t device) {
  return capi::Error(JAXSTREAMS_NOT_FOUND,
                     StrCat("jaxstreams: no CUDA pool for device ", device,
                            "; call jaxstreams.runtime.init() first"));
}

struct CudaBackend {
  using StageType = Stage;

  static SlotQueue& Queue(Stage& stage) { return *stage.queue; }
  static int32_t Device(const Stage& stage) { return stage.device; }

  static Status CreatePool(int64_t device, int64_t streams, int64_t events) {
    std::string message;
    JaxstreamsStatus code =
        Runtime::Get().CreatePool(device, streams, events, &message);
    if (code != JAXSTREAMS_OK) return capi::Error(code, std::move(message));
    return Status::Ok();
  }
  static bool PoolInfo(int64_t device, int64_t* streams, int64_t* events) {
    Pool* pool = Runtime::Get().FindPool(device);
    if (pool == nullptr) return false;
    *streams = static_cast<int64_t>(pool->streams.size());
    *events = static_cast<int64_t>(pool->events.size());
    return true;
  }
  static void DestroyAllPools() { Runtime::Get().DestroyAllPools(); }
  static Status Synchronize(int64_t device) {
    Pool* pool = Runtime::Get().FindPool(device);
    if (pool == nullptr) return NoPool(device);
    DeviceGuard guard(pool->device);
    for (cudaStream_t s : pool->streams) {
      JS_CAPI_CUDA("cudaStreamSynchronize(runtime stream)", cudaStreamSynchronize(s));
    }
    JS_CAPI_CUDA("cudaStreamSynchronize(copy stream)",
                 cudaStreamSynchronize(pool->copy));
    return Status::Ok();
  }

  static Status CreateStage(int64_t device, int64_t capacity,
                            int64_t item_bytes, int64_t* id) {
    std::string message;
    JaxstreamsStatus code =
        Runtime::Get().CreateStage(device, capacity, item_bytes, id, &message);
    if (code != JAXSTREAMS_OK) return capi::Error(code, std::move(message));
    return Status::Ok();
  }
  static std::shared_ptr<Stage> FindStage(int64_t id) {
    return Runtime::Get().FindStage(id);
  }
  static bool DestroyStage(int64_t id) { return Runtime::Get().DestroyStage(id); }

  static Status StartTransfer(std::shared_ptr<Stage> stage, int64_t slot,
                              int64_t n, const void* const* ptrs,
                              const int64_t* sizes, int64_t delay_us) {
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
                   LaunchSpin(stage->copy, delay_us * 1000));
    }
    JS_CAPI_CUDA("cudaMemcpyAsync(host to device slot)",
                 cudaMemcpyAsync(stage->device_slot(slot), stage->pinned_slot(slot),
                                 static_cast<size_t>(stage->item_bytes),
                                 cudaMemcpyHostToDevice, stage->copy));
    JS_CAPI_CUDA("cudaEventRecord(slot ready)",
                 cudaEventRecord(stage->ready[slot], stage->copy));
    return Status::Ok();
  }

  static Status TimelineReset(int64_t device, int64_t capacity) {
    Pool* pool = Runtime::Get().FindPool(device);
    if (pool == nullptr) return NoPool(device);
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
    return Status::Ok();
  }

  static Status TimelineRead(int64_t device, JaxstreamsMarker* out, int64_t max,
                             int64_t* count, int64_t* dropped) {
    Pool* pool = Runtime::Get().FindPool(device);
    if (pool == nullptr) return NoPool(device);
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
    return Status::Ok();
  }
};

}  // namespace
}  // namespace jaxstreams::cuda

JAXSTREAMS_DEFINE_CAPI(JaxstreamsCuda, jaxstreams::cuda::CudaBackend)
