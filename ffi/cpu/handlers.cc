// CPU handlers of the runtime: events recorded and waited on the runtime's
// in-order workers or on the caller (XLA's thread), a delay for tests, timing
// markers, and the consumer side of a stage area.
//
// "stream" attribute: -1 is the caller, i.e. the point in XLA's program where
// the handler runs; k >= 0 is runtime stream k (worker thread k).

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "common/guard.h"
#include "common/passthrough.h"
#include "common/stage_take.h"
#include "cpu/cpu_handlers.h"
#include "cpu/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxstreams::cpu {
namespace {

constexpr int64_t kCaller = -1;

ffi::Error CopyHost(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return ffi::Error::Success();
}

ffi::Error CheckStream(const char* where, int64_t stream) {
  if (stream < kCaller) {
    return InvalidArgument(where, "stream must be -1 (the caller's stream) or "
                           "a runtime stream id >= 0, got ", stream);
  }
  return ffi::Error::Success();
}

// A future that is already complete, for handlers that finish synchronously
// or fail before starting anything asynchronous.
ffi::Future ReadyFuture(ffi::Error error = ffi::Error::Success()) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (error.success()) {
    promise.SetAvailable();
  } else {
    promise.SetError(std::move(error));
  }
  return future;
}

// jaxstreams_record: the event's next generation completes when `stream`
// reaches this point (at once for the caller).
ffi::Error Record(ffi::RemainingArgs args, ffi::RemainingRets rets,
                  int64_t event, int64_t stream) {
  constexpr const char* kWhere = "jaxstreams_record";
  FFI_RETURN_IF_ERROR(CheckStream(kWhere, stream));
  FFI_RETURN_IF_ERROR(PassThrough(kWhere, args, rets, CopyHost));
  FFI_ASSIGN_OR_RETURN(CpuEvent * ev, Runtime::Get().Event(kWhere, event));
  if (stream == kCaller) {
    ev->RecordNow();
  } else {
    FFI_ASSIGN_OR_RETURN(InOrderWorker * worker,
                         Runtime::Get().Stream(kWhere, stream));
    ev->RecordOn(*worker);
  }
  return ffi::Error::Success();
}

// jaxstreams_wait: `stream` does not go on until the event's latest recorded
// generation completed. For the caller this is an ffi::Future, so XLA:CPU can
// run other independent work meanwhile; for a worker, a task that blocks it.
ffi::Future Wait(ffi::RemainingArgs args, ffi::RemainingRets rets,
                 int64_t event, int64_t stream) {
  constexpr const char* kWhere = "jaxstreams_wait";
  if (auto e = CheckStream(kWhere, stream); !e.success()) return ReadyFuture(e);
  if (auto e = PassThrough(kWhere, args, rets, CopyHost); !e.success()) {
    return ReadyFuture(e);
  }
  auto ev = Runtime::Get().Event(kWhere, event);
  if (ev.has_error()) return ReadyFuture(ev.error());
  CpuEvent* e = *ev;
  uint64_t gen = e->Latest();
  if (stream != kCaller) {
    auto worker = Runtime::Get().Stream(kWhere, stream);
    if (worker.has_error()) return ReadyFuture(worker.error());
    (*worker)->Enqueue([e, gen] { e->BlockUntil(gen); });
    return ReadyFuture();
  }
  // Already complete: XLA goes on on its own thread, no hop.
  if (e->Done(gen)) return ReadyFuture();
  auto completion = Runtime::Get().CompletionWorker(kWhere);
  if (completion.has_error()) return ReadyFuture(completion.error());
  ffi::Promise promise;
  ffi::Future future(promise);
  e->WhenComplete(gen, [worker = *completion, promise]() mutable {
    worker->Enqueue([promise]() mutable { promise.SetAvailable(); });
  });
  return future;
}

// jaxstreams_delay: keeps `stream` busy for `microseconds`; a slow producer
// for tests and demos (a spin kernel on CUDA).
ffi::Error Delay(ffi::RemainingArgs args, ffi::RemainingRets rets,
                 int64_t microseconds, int64_t stream) {
  constexpr const char* kWhere = "jaxstreams_delay";
  FFI_RETURN_IF_ERROR(CheckStream(kWhere, stream));
  if (microseconds < 0) {
    return InvalidArgument(kWhere, "microseconds must be >= 0, got ",
                           microseconds);
  }
  FFI_RETURN_IF_ERROR(PassThrough(kWhere, args, rets, CopyHost));
  auto sleep = [microseconds] {
    std::this_thread::sleep_for(std::chrono::microseconds(microseconds));
  };
  if (stream == kCaller) {
    sleep();
  } else {
    FFI_ASSIGN_OR_RETURN(InOrderWorker * worker,
                         Runtime::Get().Stream(kWhere, stream));
    worker->Enqueue(sleep);
  }
  return ffi::Error::Success();
}

void StoreMarker(int64_t region, int64_t phase, int64_t track,
                 int64_t stream) {
  Runtime& rt = Runtime::Get();
  int64_t i = rt.markers().Reserve();
  if (i < 0) return;  // full: counted as dropped
  JaxstreamsMarker& m = rt.markers().at(i);
  m.t_ns = rt.NowNs();
  m.region = region;
  m.phase = static_cast<int32_t>(phase);
  m.track = static_cast<int32_t>(track);
  m.device = 0;
  m.stream = static_cast<int32_t>(stream);
}

// jaxstreams_marker: a timestamp from the steady clock when `stream` reaches
// this point.
ffi::Error Marker(ffi::RemainingArgs args, ffi::RemainingRets rets,
                  int64_t region, int64_t phase, int64_t track,
                  int64_t stream) {
  constexpr const char* kWhere = "jaxstreams_marker";
  FFI_RETURN_IF_ERROR(CheckStream(kWhere, stream));
  FFI_RETURN_IF_ERROR(PassThrough(kWhere, args, rets, CopyHost));
  if (stream == kCaller) {
    StoreMarker(region, phase, track, stream);
  } else {
    FFI_ASSIGN_OR_RETURN(InOrderWorker * worker,
                         Runtime::Get().Stream(kWhere, stream));
    worker->Enqueue([=] { StoreMarker(region, phase, track, stream); });
  }
  return ffi::Error::Success();
}

// jaxstreams_stage_get: hands the consumer the oldest item put into the stage.
// Its operands (`after`) are only ordering dependencies and are not read.
// Waits (host side, bounded by timeout_ms) until a put was issued, then,
// asynchronously, for that slot's ready event; copies the slot into the
// results and releases the slot.
ffi::Future StageGet(ffi::RemainingArgs after, ffi::RemainingRets rets,
                     int64_t stage_id, int64_t timeout_ms) {
  constexpr const char* kWhere = "jaxstreams_stage_get";
  std::shared_ptr<StageArea> stage = Runtime::Get().FindStage(stage_id);
  if (!stage) {
    return ReadyFuture(MakeError(ffi::ErrorCode::kNotFound, kWhere,
                                 "no stage with id ", stage_id,
                                 " (it was never created or was destroyed)"));
  }
  auto taken = TakeStageItem(kWhere, stage_id, stage->item_bytes, stage->queue,
                             rets, timeout_ms);
  if (taken.has_error()) return ReadyFuture(taken.error());
  int64_t slot = *taken;
  // Where each result's bytes come from in the slot. Collected now: the
  // results object is only valid during this call.
  struct Piece {
    void* dst;
    size_t bytes;
  };
  std::vector<Piece> pieces;
  pieces.reserve(rets.size());
  for (size_t i = 0; i < rets.size(); ++i) {
    auto out = rets.get<ffi::AnyBuffer>(i);
    pieces.push_back({(*out)->untyped_data(), (*out)->size_bytes()});
  }
  uint64_t gen = stage->ready_gen[static_cast<size_t>(slot)];
  auto copy_out = [stage, slot](const std::vector<Piece>& pieces) {
    const char* src = stage->device_slot(slot);
    for (const Piece& p : pieces) {
      std::memcpy(p.dst, src, p.bytes);
      src += p.bytes;
    }
    stage->queue.Release(slot);
  };
  // The copy stream already filled the slot: copy out here, no thread hop.
  if (stage->ready[slot].Done(gen)) {
    copy_out(pieces);
    return ReadyFuture();
  }
  auto completion = Runtime::Get().CompletionWorker(kWhere);
  if (completion.has_error()) {
    stage->queue.Release(slot);
    return ReadyFuture(completion.error());
  }
  ffi::Promise promise;
  ffi::Future future(promise);
  auto finish = [copy_out, pieces = std::move(pieces), promise]() mutable {
    copy_out(pieces);
    promise.SetAvailable();
  };
  stage->ready[slot].WhenComplete(
      gen, [worker = *completion, finish = std::move(finish)]() mutable {
        worker->Enqueue(std::move(finish));
      });
  return future;
}

}  // namespace
}  // namespace jaxstreams::cpu

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsRecordCpu, jaxstreams::cpu::Record,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("event")
                                  .Attr<int64_t>("stream"));

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsWaitCpu, jaxstreams::cpu::Wait,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("event")
                                  .Attr<int64_t>("stream"));

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsDelayCpu, jaxstreams::cpu::Delay,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("microseconds")
                                  .Attr<int64_t>("stream"));

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsMarkerCpu, jaxstreams::cpu::Marker,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("region")
                                  .Attr<int64_t>("phase")
                                  .Attr<int64_t>("track")
                                  .Attr<int64_t>("stream"));

JAXSTREAMS_DEFINE_GUARDED_HANDLER(JaxstreamsStageGetCpu, jaxstreams::cpu::StageGet,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("stage")
                                  .Attr<int64_t>("timeout_ms"));
