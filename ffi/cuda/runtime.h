// Process-wide state of the CUDA runtime: per-device pools (runtime streams,
// a copy stream, dependency events, timing events for markers) and stage
// areas (pinned host slots, device slots, per-slot ready/consumed events).
//
// Everything is created from Python through the C API before the programs
// that use it run; the handlers on the execute path only look things up and
// enqueue work, never create streams or allocate.

#ifndef JAXSTREAMS_FFI_CUDA_RUNTIME_H_
#define JAXSTREAMS_FFI_CUDA_RUNTIME_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "common/capi_types.h"
#include "common/marker_log.h"
#include "common/slot_queue.h"
#include "common/stage_registry.h"
#include "xla/ffi/api/ffi.h"

namespace jaxstreams::cuda {

// Makes `device` current for the scope and restores the previous device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

struct Pool {
  ~Pool();  // destroys the streams and events (no program may be running)

  int device = 0;
  std::vector<cudaStream_t> streams;  // runtime streams 0..n-1
  cudaStream_t copy = nullptr;        // the copy stream stages use
  std::vector<cudaEvent_t> events;    // dependency events (no timing)

  // Markers: timing_events[i] is recorded by the i-th marker since the last
  // reset; times are read relative to timing_events[0].
  MarkerLog markers;
  std::vector<cudaEvent_t> timing_events;
};

struct Stage {
  ~Stage();  // waits for in-flight copies, then frees the memory

  int64_t id = 0;
  int device = 0;
  int64_t item_bytes = 0;
  std::unique_ptr<SlotQueue> queue;
  char* pinned = nullptr;  // capacity * item_bytes of page-locked host memory
  char* slots = nullptr;   // capacity * item_bytes of device memory
  std::vector<cudaEvent_t> ready;     // slot filled (recorded on copy stream)
  std::vector<cudaEvent_t> consumed;  // slot read out (recorded on consumer)
  cudaStream_t copy = nullptr;        // the device pool's copy stream
  int64_t allocations = 0;

  char* pinned_slot(int64_t i) const { return pinned + i * item_bytes; }
  char* device_slot(int64_t i) const { return slots + i * item_bytes; }
};

class Runtime {
 public:
  static constexpr int kMaxDevices = 64;
  static constexpr int64_t kFirstStageId = int64_t{1} << 40;

  static Runtime& Get();

  JaxstreamsStatus CreatePool(int64_t device, int64_t num_streams,
                              int64_t num_events, std::string* error);
  Pool* FindPool(int64_t device);  // nullptr if none
  ::xla::ffi::ErrorOr<Pool*> GetPool(const char* where, int64_t device);
  void DestroyAllPools();

  JaxstreamsStatus CreateStage(int64_t device, int64_t capacity,
                               int64_t item_bytes, int64_t* id,
                               std::string* error);
  std::shared_ptr<Stage> FindStage(int64_t id);
  bool DestroyStage(int64_t id);

 private:
  Runtime() = default;

  std::mutex mu_;
  std::atomic<Pool*> pools_[kMaxDevices] = {};
  StageRegistry<Stage> stages_{kFirstStageId};
};

// The stream a handler's "stream" attribute names: XLA's for -1, else the
// pool's runtime stream k.
::xla::ffi::ErrorOr<cudaStream_t> SelectStream(const char* where, Pool& pool,
                                               cudaStream_t xla_stream,
                                               int64_t stream);

}  // namespace jaxstreams::cuda

#endif  // JAXSTREAMS_FFI_CUDA_RUNTIME_H_
