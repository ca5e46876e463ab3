// The C API of the CPU library (see common/capi.h), called from Python with
// ctypes. CPU devices share one pool, so `device` is accepted and ignored.

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "common/capi.h"
#include "common/errors.h"
#include "common/version.h"
#include "cpu/runtime.h"
#include "xla/ffi/api/c_api.h"

using jaxstreams::Fail;
using jaxstreams::StrCat;
using jaxstreams::cpu::Runtime;
using jaxstreams::cpu::StageArea;

JAXSTREAMS_DECLARE_CAPI(JaxstreamsCpu)

int JaxstreamsCpuAbiVersion(void) { return JAXSTREAMS_FFI_ABI_VERSION; }

// The XLA FFI API version of the headers this library was compiled against,
// major * 1000 + minor: the loader compares it with the running jaxlib's
// before registering any handler (jaxlib refuses handlers newer than itself).
extern "C" JAXSTREAMS_EXPORT int JaxstreamsCpuFfiApiVersion(void) {
  return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR;
}

int JaxstreamsCpuPoolCreate(int64_t device, int64_t streams, int64_t events,
                            char* err, int64_t errlen) {
  std::string message;
  JaxstreamsStatus status = Runtime::Get().CreatePool(streams, events, &message);
  if (status != JAXSTREAMS_OK) return Fail(status, message, err, errlen);
  return JAXSTREAMS_OK;
}

int JaxstreamsCpuPoolInfo(int64_t device, int64_t* streams, int64_t* events) {
  return Runtime::Get().GetPoolSizes(streams, events) ? 1 : 0;
}

void JaxstreamsCpuPoolDestroyAll(void) { Runtime::Get().DestroyPool(); }

int JaxstreamsCpuSynchronize(int64_t device, char* err, int64_t errlen) {
  Runtime::Get().Synchronize();
  return JAXSTREAMS_OK;
}

int JaxstreamsCpuStageCreate(int64_t device, int64_t capacity,
                             int64_t item_bytes, int64_t* id, char* err,
                             int64_t errlen) {
  std::string message;
  JaxstreamsStatus status =
      Runtime::Get().CreateStage(capacity, item_bytes, id, &message);
  if (status != JAXSTREAMS_OK) return Fail(status, message, err, errlen);
  return JAXSTREAMS_OK;
}

int JaxstreamsCpuStagePut(int64_t id, int64_t n, const void* const* ptrs,
                          const int64_t* sizes, int64_t timeout_ms,
                          int64_t delay_us, char* err, int64_t errlen) {
  std::shared_ptr<StageArea> stage = Runtime::Get().FindStage(id);
  if (!stage) {
    return Fail(JAXSTREAMS_NOT_FOUND, StrCat("jaxstreams: no stage with id ", id),
                err, errlen);
  }
  if (int status = jaxstreams::CheckPutBuffers(id, n, ptrs, sizes,
                                               stage->item_bytes, err,
                                               errlen);
      status != JAXSTREAMS_OK) {
    return status;
  }
  auto copy = Runtime::Get().CopyWorker("stage put");
  if (copy.has_error()) {
    return Fail(JAXSTREAMS_INVALID_ARGUMENT, copy.error().message(), err, errlen);
  }
  int64_t slot = -1;
  switch (stage->queue.AcquireFree(timeout_ms, &slot)) {
    case jaxstreams::SlotWait::kOk:
      break;
    case jaxstreams::SlotWait::kTimeout:
      return Fail(JAXSTREAMS_TIMEOUT,
                  StrCat("jaxstreams: stage ", id, " is full: all ",
                         stage->queue.capacity(),
                         " slots hold items no consumer has taken (waited ",
                         timeout_ms, " ms)"),
                  err, errlen);
    case jaxstreams::SlotWait::kClosed:
      return Fail(JAXSTREAMS_CLOSED,
                  StrCat("jaxstreams: stage ", id, " is closed"), err, errlen);
  }
  // The caller's buffers are copied now, so they may be reused as soon as
  // this returns; the copy into the "device" slot runs on the copy worker.
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
  stage->queue.Publish(slot);
  return JAXSTREAMS_OK;
}

int JaxstreamsCpuStageClose(int64_t id) {
  std::shared_ptr<StageArea> stage = Runtime::Get().FindStage(id);
  if (!stage) return JAXSTREAMS_NOT_FOUND;
  stage->queue.Close();
  return JAXSTREAMS_OK;
}

int JaxstreamsCpuStageDestroy(int64_t id) {
  return Runtime::Get().DestroyStage(id) ? JAXSTREAMS_OK : JAXSTREAMS_NOT_FOUND;
}

int JaxstreamsCpuStageStats(int64_t id, JaxstreamsStageStats* out) {
  std::shared_ptr<StageArea> stage = Runtime::Get().FindStage(id);
  if (!stage) return JAXSTREAMS_NOT_FOUND;
  auto c = stage->queue.counters();
  out->capacity = stage->queue.capacity();
  out->item_bytes = stage->item_bytes;
  out->puts = c.puts;
  out->gets = c.gets;
  out->queued = c.queued;
  out->free_slots = c.free_slots;
  out->allocations = stage->allocations;
  out->last_slot = c.last_slot;
  out->closed = c.closed ? 1 : 0;
  out->device = 0;
  return JAXSTREAMS_OK;
}

int JaxstreamsCpuTimelineReset(int64_t device, int64_t capacity, char* err,
                               int64_t errlen) {
  if (capacity < 0) {
    return Fail(JAXSTREAMS_INVALID_ARGUMENT,
                StrCat("jaxstreams: timeline capacity must be >= 0, got ",
                       capacity),
                err, errlen);
  }
  Runtime::Get().Synchronize();  // no marker of the old session lands late
  Runtime::Get().ResetMarkers(capacity);
  return JAXSTREAMS_OK;
}

int JaxstreamsCpuTimelineRead(int64_t device, JaxstreamsMarker* out,
                              int64_t max, int64_t* count, int64_t* dropped,
                              char* err, int64_t errlen) {
  Runtime& rt = Runtime::Get();
  rt.Synchronize();  // markers queued on workers have landed
  int64_t n = std::min(rt.markers().size(), max);
  for (int64_t i = 0; i < n; ++i) out[i] = rt.markers().at(i);
  *count = n;
  *dropped = rt.markers().dropped();
  return JAXSTREAMS_OK;
}
