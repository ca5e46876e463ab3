#include "cuda/runtime.h"

#include <utility>

#include "common/errors.h"

namespace ffi = xla::ffi;

namespace jaxstreams::cuda {

constexpr int64_t kMaxStreams = 64;
constexpr int64_t kMaxEvents = 1 << 20;

DeviceGuard::DeviceGuard(int device) {
  status_ = cudaGetDevice(&previous_);
  if (status_ == cudaSuccess && previous_ != device) {
    status_ = cudaSetDevice(device);
  }
}

DeviceGuard::~DeviceGuard() {
  int current = -1;
  if (previous_ >= 0 && cudaGetDevice(&current) == cudaSuccess &&
      current != previous_) {
    cudaSetDevice(previous_);
  }
}

Pool::~Pool() {
  DeviceGuard guard(device);
  for (cudaStream_t s : streams) cudaStreamSynchronize(s);
  if (copy) cudaStreamSynchronize(copy);
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  for (cudaEvent_t e : timing_events) cudaEventDestroy(e);
  for (cudaStream_t s : streams) cudaStreamDestroy(s);
  if (copy) cudaStreamDestroy(copy);
}

Stage::~Stage() {
  DeviceGuard guard(device);
  for (cudaEvent_t e : ready) {
    cudaEventSynchronize(e);
    cudaEventDestroy(e);
  }
  for (cudaEvent_t e : consumed) {
    cudaEventSynchronize(e);
    cudaEventDestroy(e);
  }
  if (slots) cudaFree(slots);
  if (pinned) cudaFreeHost(pinned);
}

Runtime& Runtime::Get() {
  // Leaked on purpose: CUDA objects must not be destroyed by static
  // destructors after the driver may already have shut down.
  static Runtime* runtime = new Runtime();
  return *runtime;
}

static std::string CudaMessage(const char* what, cudaError_t err) {
  return StrCat("jaxstreams: ", what, " failed: ", cudaGetErrorName(err), ": ",
                cudaGetErrorString(err));
}

JaxstreamsStatus Runtime::CreatePool(int64_t device, int64_t num_streams,
                                     int64_t num_events, std::string* error) {
  if (device < 0 || device >= kMaxDevices) {
    *error = StrCat("jaxstreams: CUDA device ordinal must be in [0, ",
                    kMaxDevices, "), got ", device);
    return JAXSTREAMS_INVALID_ARGUMENT;
  }
  if (num_streams < 1 || num_streams > kMaxStreams || num_events < 1 ||
      num_events > kMaxEvents) {
    *error = StrCat("jaxstreams: a CUDA pool needs streams in [1, ", kMaxStreams,
                    "] and events in [1, ", kMaxEvents, "], got ", num_streams,
                    " and ", num_events);
    return JAXSTREAMS_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (Pool* existing = pools_[device].load()) {
    if (static_cast<int64_t>(existing->streams.size()) == num_streams &&
        static_cast<int64_t>(existing->events.size()) == num_events) {
      return JAXSTREAMS_OK;
    }
    *error = StrCat("jaxstreams: the CUDA pool of device ", device,
                    " already exists with ", existing->streams.size(),
                    " streams and ", existing->events.size(), " events");
    return JAXSTREAMS_INVALID_ARGUMENT;
  }
  DeviceGuard guard(static_cast<int>(device));
  if (guard.status() != cudaSuccess) {
    *error = CudaMessage(StrCat("cudaSetDevice(", device, ")").c_str(),
                         guard.status());
    return JAXSTREAMS_INTERNAL;
  }
  auto pool = std::make_unique<Pool>();
  pool->device = static_cast<int>(device);
  cudaError_t err = cudaSuccess;
  for (int64_t k = 0; k < num_streams && err == cudaSuccess; ++k) {
    cudaStream_t s = nullptr;
    err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (err == cudaSuccess) pool->streams.push_back(s);
  }
  if (err == cudaSuccess) {
    err = cudaStreamCreateWithFlags(&pool->copy, cudaStreamNonBlocking);
  }
  for (int64_t i = 0; i < num_events && err == cudaSuccess; ++i) {
    cudaEvent_t e = nullptr;
    err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (err == cudaSuccess) pool->events.push_back(e);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    *error = CudaMessage(StrCat("creating the stream/event pool of device ",
                                device).c_str(), err);
    return JAXSTREAMS_INTERNAL;  // `pool` cleans up what was created
  }
  pools_[device].store(pool.release());
  return JAXSTREAMS_OK;
}

Pool* Runtime::FindPool(int64_t device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return pools_[device].load();
}

ffi::ErrorOr<Pool*> Runtime::GetPool(const char* where, int64_t device) {
  Pool* pool = FindPool(device);
  if (pool == nullptr) {
    return ffi::Unexpected(MakeError(
        ffi::ErrorCode::kFailedPrecondition, where,
        "the CUDA runtime pool of device ", device,
        " was not created; call jaxstreams.runtime.init() (done "
        "automatically by the Python wrappers) before running the program"));
  }
  return pool;
}

void Runtime::DestroyAllPools() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& slot : pools_) delete slot.exchange(nullptr);
}

JaxstreamsStatus Runtime::CreateStage(int64_t device, int64_t capacity,
                                      int64_t item_bytes, int64_t* id,
                                      std::string* error) {
  Pool* pool = FindPool(device);
  if (pool == nullptr) {
    *error = StrCat("jaxstreams: create the CUDA pool of device ", device,
                    " (jaxstreams.runtime.init()) before a stage on it");
    return JAXSTREAMS_INVALID_ARGUMENT;
  }
  if (std::string bad = CheckStageSize(capacity, item_bytes); !bad.empty()) {
    *error = std::move(bad);
    return JAXSTREAMS_INVALID_ARGUMENT;
  }
  DeviceGuard guard(static_cast<int>(device));
  auto stage = std::make_shared<Stage>();
  stage->device = static_cast<int>(device);
  stage->item_bytes = item_bytes;
  stage->copy = pool->copy;
  stage->queue = std::make_unique<SlotQueue>(capacity);
  size_t bytes = static_cast<size_t>(capacity * item_bytes);
  cudaError_t err = guard.status();
  if (err == cudaSuccess) {
    err = cudaHostAlloc(reinterpret_cast<void**>(&stage->pinned), bytes,
                        cudaHostAllocPortable);
  }
  if (err == cudaSuccess) {
    err = cudaMalloc(reinterpret_cast<void**>(&stage->slots), bytes);
  }
  for (int64_t i = 0; i < capacity && err == cudaSuccess; ++i) {
    cudaEvent_t ready = nullptr, consumed = nullptr;
    err = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    if (err == cudaSuccess) {
      stage->ready.push_back(ready);
      err = cudaEventCreateWithFlags(&consumed, cudaEventDisableTiming);
    }
    if (err == cudaSuccess) stage->consumed.push_back(consumed);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    *error = CudaMessage(StrCat("allocating a stage of ", capacity, " x ",
                                item_bytes, " bytes on device ", device).c_str(),
                         err);
    return JAXSTREAMS_INTERNAL;
  }
  stage->allocations = 4;  // pinned, device, ready events, consumed events
  *id = stages_.Add([&](int64_t new_id) {
    stage->id = new_id;
    return stage;
  });
  return JAXSTREAMS_OK;
}

std::shared_ptr<Stage> Runtime::FindStage(int64_t id) { return stages_.Find(id); }

bool Runtime::DestroyStage(int64_t id) {
  std::shared_ptr<Stage> stage = stages_.Remove(id);
  if (!stage) return false;
  stage->queue->Close();
  return true;  // freed when the last handler holding it returns
}

ffi::ErrorOr<cudaStream_t> SelectStream(const char* where, Pool& pool,
                                        cudaStream_t xla_stream,
                                        int64_t stream) {
  if (stream == -1) return xla_stream;
  if (stream < 0 || stream >= static_cast<int64_t>(pool.streams.size())) {
    return ffi::Unexpected(InvalidArgument(
        where, "stream must be -1 (the caller's stream) or a runtime stream in "
        "[0, ", pool.streams.size(), "), got ", stream));
  }
  return pool.streams[static_cast<size_t>(stream)];
}

}  // namespace jaxstreams::cuda
