// CUDA handlers of the runtime. Each runs on the host when XLA reaches it
// and enqueues work on the stream XLA hands it (PlatformStream) or on a
// runtime stream of the device's pool; none blocks on the GPU.
//
// DESIGN.md's rule holds: work a handler puts on a runtime stream touches
// only memory the runtime owns (stage slots) or nothing (delay, markers);
// XLA's buffers are only touched on XLA's stream.

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "common/errors.h"
#include "common/guard.h"
#include "common/passthrough.h"
#include "common/stage_take.h"
#include "cuda/cuda_errors.h"
#include "cuda/cuda_handlers.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxstreams::cuda {
namespace {

// Result i <- operand i on XLA's stream when XLA did not alias them.
auto CopyOn(cudaStream_t stream, const char* where) {
  return [stream, where](void* dst, const void* src, size_t bytes) -> ffi::Error {
    JS_CUDA_RETURN_IF_ERROR(where, cudaMemcpyAsync(dst, src, bytes,
                                                   cudaMemcpyDeviceToDevice,
                                                   stream));
    return ffi::Error::Success();
  };
}

ffi::ErrorOr<cudaEvent_t> PoolEvent(const char* where, Pool& pool,
                                    int64_t event) {
  if (event < 0 || event >= static_cast<int64_t>(pool.events.size())) {
    return ffi::Unexpected(InvalidArgument(
        where, "event ", event, " is out of range [0, ", pool.events.size(),
        ") (the pool of device ", pool.device, " has ", pool.events.size(),
        " events)"));
  }
  return pool.events[static_cast<size_t>(event)];
}

ffi::Error Record(cudaStream_t xla_stream, int32_t device,
                  ffi::RemainingArgs args, ffi::RemainingRets rets,
                  int64_t event, int64_t stream) {
  constexpr const char* kWhere = "jaxstreams_record";
  FFI_RETURN_IF_ERROR(PassThrough(kWhere, args, rets, CopyOn(xla_stream, kWhere)));
  FFI_ASSIGN_OR_RETURN(Pool * pool, Runtime::Get().GetPool(kWhere, device));
  FFI_ASSIGN_OR_RETURN(cudaEvent_t ev, PoolEvent(kWhere, *pool, event));
  FFI_ASSIGN_OR_RETURN(cudaStream_t s,
                       SelectStream(kWhere, *pool, xla_stream, stream));
  JS_CUDA_RETURN_IF_ERROR(kWhere, cudaEventRecord(ev, s));
  return ffi::Error::Success();
}

ffi::Error Wait(cudaStream_t xla_stream, int32_t device,
                ffi::RemainingArgs args, ffi::RemainingRets rets,
                int64_t event, int64_t stream) {
  constexpr const char* kWhere = "jaxstreams_wait";
  FFI_ASSIGN_OR_RETURN(Pool * pool, Runtime::Get().GetPool(kWhere, device));
  FFI_ASSIGN_OR_RETURN(cudaEvent_t ev, PoolEvent(kWhere, *pool, event));
  FFI_ASSIGN_OR_RETURN(cudaStream_t s,
                       SelectStream(kWhere, *pool, xla_stream, stream));
  JS_CUDA_RETURN_IF_ERROR(kWhere, cudaStreamWaitEvent(s, ev, 0));
  // After the wait, so results are written only once the event completed.
  FFI_RETURN_IF_ERROR(PassThrough(kWhere, args, rets, CopyOn(xla_stream, kWhere)));
  return ffi::Error::Success();
}

ffi::Error Delay(cudaStream_t xla_stream, int32_t device,
                 ffi::RemainingArgs args, ffi::RemainingRets rets,
                 int64_t microseconds, int64_t stream) {
  constexpr const char* kWhere = "jaxstreams_delay";
  if (microseconds < 0) {
    return InvalidArgument(kWhere, "microseconds must be >= 0, got ",
                           microseconds);
  }
  FFI_RETURN_IF_ERROR(PassThrough(kWhere, args, rets, CopyOn(xla_stream, kWhere)));
  FFI_ASSIGN_OR_RETURN(Pool * pool, Runtime::Get().GetPool(kWhere, device));
  FFI_ASSIGN_OR_RETURN(cudaStream_t s,
                       SelectStream(kWhere, *pool, xla_stream, stream));
  JS_CUDA_RETURN_IF_ERROR(kWhere, LaunchSpin(s, microseconds * 1000));
  return ffi::Error::Success();
}

ffi::Error Marker(cudaStream_t xla_stream, int32_t device,
                  ffi::RemainingArgs args, ffi::RemainingRets rets,
                  int64_t region, int64_t phase, int64_t track,
                  int64_t stream) {
  constexpr const char* kWhere = "jaxstreams_marker";
  FFI_RETURN_IF_ERROR(PassThrough(kWhere, args, rets, CopyOn(xla_stream, kWhere)));
  FFI_ASSIGN_OR_RETURN(Pool * pool, Runtime::Get().GetPool(kWhere, device));
  FFI_ASSIGN_OR_RETURN(cudaStream_t s,
                       SelectStream(kWhere, *pool, xla_stream, stream));
  int64_t i = pool->markers.Reserve();
  if (i < 0) return ffi::Error::Success();  // log full: counted as dropped
  JaxstreamsMarker& m = pool->markers.at(i);
  m.t_ns = 0;  // filled in by TimelineRead from the event
  m.region = region;
  m.phase = static_cast<int32_t>(phase);
  m.track = static_cast<int32_t>(track);
  m.device = device;
  m.stream = static_cast<int32_t>(stream);
  JS_CUDA_RETURN_IF_ERROR(
      kWhere, cudaEventRecord(pool->timing_events[static_cast<size_t>(i)], s));
  return ffi::Error::Success();
}

// Hands the consumer the oldest item: waits on the host until a put was
// issued, makes XLA's stream wait for the slot's ready event, copies the
// device slot into the results on XLA's stream, records the slot's consumed
// event there (the next put into the slot waits for it) and releases it.
// Its operands (`after`) are only ordering dependencies and are not read.
ffi::Error StageGet(cudaStream_t xla_stream, int32_t device,
                    ffi::RemainingArgs after, ffi::RemainingRets rets,
                    int64_t stage_id,
                    int64_t timeout_ms) {
  constexpr const char* kWhere = "jaxstreams_stage_get";
  std::shared_ptr<Stage> stage = Runtime::Get().FindStage(stage_id);
  if (!stage) {
    return MakeError(ffi::ErrorCode::kNotFound, kWhere, "no CUDA stage with id ",
                     stage_id, stage_id < Runtime::kFirstStageId
                                   ? " (that id belongs to a CPU stage)"
                                   : " (it was destroyed)");
  }
  if (stage->device != device) {
    return InvalidArgument(kWhere, "stage ", stage_id, " lives on GPU ",
                           stage->device, " but the program runs on GPU ",
                           device);
  }
  FFI_ASSIGN_OR_RETURN(int64_t slot,
                       TakeStageItem(kWhere, stage_id, stage->item_bytes,
                                     *stage->queue, rets, timeout_ms));
  ffi::Error status = [&]() -> ffi::Error {
    JS_CUDA_RETURN_IF_ERROR(
        kWhere, cudaStreamWaitEvent(xla_stream, stage->ready[slot], 0));
    const char* src = stage->device_slot(slot);
    for (size_t i = 0; i < rets.size(); ++i) {
      FFI_ASSIGN_OR_RETURN(auto out, rets.get<ffi::AnyBuffer>(i));
      size_t bytes = out->size_bytes();
      if (bytes > 0) {
        JS_CUDA_RETURN_IF_ERROR(
            kWhere, cudaMemcpyAsync(out->untyped_data(), src, bytes,
                                    cudaMemcpyDeviceToDevice, xla_stream));
      }
      src += bytes;
    }
    JS_CUDA_RETURN_IF_ERROR(
        kWhere, cudaEventRecord(stage->consumed[slot], xla_stream));
    return ffi::Error::Success();
  }();
  stage->queue->Release(slot);
  return status;
}

}  // namespace
}  // namespace jaxstreams::cuda

#define JAXSTREAMS_CUDA_BIND                          \
  ffi::Ffi::Bind()                                    \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()       \
      .Ctx<ffi::DeviceOrdinal>()

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsRecordCuda, jaxstreams::cuda::Record,
                              JAXSTREAMS_CUDA_BIND.RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("event")
                                  .Attr<int64_t>("stream"));

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsWaitCuda, jaxstreams::cuda::Wait,
                              JAXSTREAMS_CUDA_BIND.RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("event")
                                  .Attr<int64_t>("stream"));

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsDelayCuda, jaxstreams::cuda::Delay,
                              JAXSTREAMS_CUDA_BIND.RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("microseconds")
                                  .Attr<int64_t>("stream"));

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsMarkerCuda, jaxstreams::cuda::Marker,
                              JAXSTREAMS_CUDA_BIND.RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("region")
                                  .Attr<int64_t>("phase")
                                  .Attr<int64_t>("track")
                                  .Attr<int64_t>("stream"));

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsStageGetCuda,
                              jaxstreams::cuda::StageGet,
                              JAXSTREAMS_CUDA_BIND.RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("stage")
                                  .Attr<int64_t>("timeout_ms"));
