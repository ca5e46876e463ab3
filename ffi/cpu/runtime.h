// Process-wide state of the CPU runtime: the pool of in-order workers (the
// "streams") and events, the stage areas, and the marker log.
//
// The pool is created once, from Python through the C API before any program
// that uses it runs (jaxstreams/runtime/_pool.py); handlers only look things
// up. CPU devices share the host, so one pool serves every CPU device.

#ifndef JAXSTREAMS_FFI_CPU_RUNTIME_H_
#define JAXSTREAMS_FFI_CPU_RUNTIME_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/capi_types.h"
#include "common/marker_log.h"
#include "common/slot_queue.h"
#include "common/stage_registry.h"
#include "cpu/event.h"
#include "cpu/worker.h"
#include "xla/ffi/api/ffi.h"

namespace jaxstreams::cpu {

// A stage area in host memory. `staging` plays the part of the pinned host
// slots (written by the producer's thread) and `slots` that of the device
// slots (written only by the copy worker); a consumer reads `slots[i]` after
// slot i's ready event, so it can only see data the copy finished.
struct StageArea {
  StageArea(int64_t id, int64_t capacity, int64_t item_bytes);

  const int64_t id;
  const int64_t item_bytes;
  SlotQueue queue;
  std::vector<char> staging;
  std::vector<char> slots;
  std::unique_ptr<CpuEvent[]> ready;
  std::vector<uint64_t> ready_gen;  // generation of ready[i] to wait for
  const int64_t allocations = 3;    // staging, slots, events: at creation only

  char* staging_slot(int64_t i) { return staging.data() + i * item_bytes; }
  char* device_slot(int64_t i) { return slots.data() + i * item_bytes; }
};

class Runtime {
 public:
  static Runtime& Get();

  // Pool ------------------------------------------------------------------
  // Creates the workers and events once. Asking again with the same sizes is
  // a no-op; with other sizes it is an error (the pool never changes).
  JaxstreamsStatus CreatePool(int64_t num_streams, int64_t num_events,
                              std::string* error);
  // Drains and joins every worker (atexit); the pool can be created again.
  void DestroyPool();
  bool GetPoolSizes(int64_t* num_streams, int64_t* num_events);

  ::xla::ffi::ErrorOr<InOrderWorker*> Stream(const char* where, int64_t k);
  ::xla::ffi::ErrorOr<CpuEvent*> Event(const char* where, int64_t id);
  ::xla::ffi::ErrorOr<InOrderWorker*> CopyWorker(const char* where);
  // Completes the futures of waiting handlers. XLA:CPU continues a program
  // on the thread that completes its future; doing that here keeps XLA's
  // work off the runtime streams (and off the copy worker), which must stay
  // free to run what is queued on them.
  ::xla::ffi::ErrorOr<InOrderWorker*> CompletionWorker(const char* where);
  // Blocks until everything queued on every worker ran.
  void Synchronize();

  // Stages ----------------------------------------------------------------
  JaxstreamsStatus CreateStage(int64_t capacity, int64_t item_bytes,
                               int64_t* id, std::string* error);
  std::shared_ptr<StageArea> FindStage(int64_t id);
  bool DestroyStage(int64_t id);

  // Markers ----------------------------------------------------------------
  MarkerLog& markers() { return markers_; }
  void ResetMarkers(int64_t capacity);
  int64_t NowNs() const;  // steady clock, relative to the last reset

 private:
  Runtime() = default;

  std::mutex mu_;
  std::vector<std::unique_ptr<InOrderWorker>> streams_;
  std::unique_ptr<InOrderWorker> copy_;
  std::unique_ptr<InOrderWorker> completion_;
  std::unique_ptr<CpuEvent[]> events_;
  int64_t num_streams_ = 0;
  int64_t num_events_ = 0;
  bool pool_ = false;

  StageRegistry<StageArea> stages_{1};

  MarkerLog markers_;
  std::chrono::steady_clock::time_point epoch_ = std::chrono::steady_clock::now();
};

}  // namespace jaxstreams::cpu

#endif  // JAXSTREAMS_FFI_CPU_RUNTIME_H_
