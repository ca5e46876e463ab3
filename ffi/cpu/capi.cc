// The CPU backend of the C API (common/capi_impl.h). CPU devices share one
// pool, so `device` is accepted and ignored.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "common/capi_impl.h"
#include "cpu/runtime.h"

namespace jaxstreams::cpu {
namespace {

using capi::Status;

Status FromRuntime(JaxstreamsStatus code, std::string message) {
  return code == JAXSTREAMS_OK ? Status::Ok() : capi::Error(code, std::move(message));
}

struct CpuBackend {
  using StageType = StageArea;

  static SlotQueue& Queue(StageArea& stage) { return stage.queue; }
  static int32_t Device(const StageArea&) { return 0; }

  static Status CreatePool(int64_t, int64_t streams, int64_t events) {
    std::string message;
    JaxstreamsStatus code = Runtime::Get().CreatePool(streams, events, &message);
    return FromRuntime(code, std::move(message));
  }
  static bool PoolInfo(int64_t, int64_t* streams, int64_t* events) {
    return Runtime::Get().GetPoolSizes(streams, events);
  }
  static void DestroyAllPools() { Runtime::Get().DestroyPool(); }
  static Status Synchronize(int64_t) {
    Runtime::Get().Synchronize();
    return Status::Ok();
  }

  static Status CreateStage(int64_t, int64_t capacity, int64_t item_bytes,
                            int64_t* id) {
    std::string message;
    JaxstreamsStatus code =
        Runtime::Get().CreateStage(capacity, item_bytes, id, &message);
    return FromRuntime(code, std::move(message));
  }
  static std::shared_ptr<StageArea> FindStage(int64_t id) {
    return Runtime::Get().FindStage(id);
  }
  static bool DestroyStage(int64_t id) { return Runtime::Get().DestroyStage(id); }

  // The caller's buffers are copied now, so they may be reused as soon as
  // this returns; the copy into the "device" slot runs on the copy worker.
  static Status StartTransfer(std::shared_ptr<StageArea> stage, int64_t slot,
                              int64_t n, const void* const* ptrs,
                              const int64_t* sizes, int64_t delay_us) {
    auto copy = Runtime::Get().CopyWorker("stage put");
    if (copy.has_error()) {
      return capi::Error(JAXSTREAMS_INVALID_ARGUMENT, copy.error().message());
    }
    char* dst = stage->staging_slot(slot);
    for (int64_t i = 0; i < n; ++i) {
      if (sizes[i] > 0) std::memcpy(dst, ptrs[i], static_cast<size_t>(sizes[i]));
      dst += sizes[i];
    }
    stage->ready_gen[static_cast<size_t>(slot)] =
        stage->ready[slot].RecordAfter(**copy, [stage, slot, delay_us] {
          if (delay_us > 0) {
            std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
          }
          std::memcpy(stage->device_slot(slot), stage->staging_slot(slot),
                      static_cast<size_t>(stage->item_bytes));
        });
    return Status::Ok();
  }

  static Status TimelineReset(int64_t, int64_t capacity) {
    Runtime::Get().Synchronize();  // no marker of the old session lands late
    Runtime::Get().ResetMarkers(capacity);
    return Status::Ok();
  }
  static Status TimelineRead(int64_t, JaxstreamsMarker* out, int64_t max,
                             int64_t* count, int64_t* dropped) {
    Runtime& rt = Runtime::Get();
    rt.Synchronize();  // markers queued on workers have landed
    int64_t n = std::min(rt.markers().size(), max);
    for (int64_t i = 0; i < n; ++i) out[i] = rt.markers().at(i);
    *count = n;
    *dropped = rt.markers().dropped();
    return Status::Ok();
  }
};

}  // namespace
}  // namespace jaxstreams::cpu

JAXSTREAMS_DEFINE_CAPI(JaxstreamsCpu, jaxstreams::cpu::CpuBackend)
