#include "cpu/runtime.h"

#include <utility>

#include "common/errors.h"

namespace ffi = xla::ffi;

namespace jaxstreams::cpu {

// Limits that catch a bad argument (e.g. a negative count passed as a huge
// number) before it turns into thousands of threads or a huge allocation.
constexpr int64_t kMaxStreams = 64;
constexpr int64_t kMaxEvents = 1 << 20;

StageArea::StageArea(int64_t id, int64_t capacity, int64_t item_bytes)
    : id(id),
      item_bytes(item_bytes),
      queue(capacity),
      staging(static_cast<size_t>(capacity * item_bytes)),
      slots(static_cast<size_t>(capacity * item_bytes)),
      ready(new CpuEvent[capacity]),
      ready_gen(static_cast<size_t>(capacity), 0) {}

Runtime& Runtime::Get() {
  // Leaked on purpose: handlers may still run while static destructors do at
  // exit. Python's atexit hook calls DestroyPool to join the workers.
  static Runtime* runtime = new Runtime();
  return *runtime;
}

JaxstreamsStatus Runtime::CreatePool(int64_t num_streams, int64_t num_events,
                                     std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pool_) {
    if (num_streams == num_streams_ && num_events == num_events_) {
      return JAXSTREAMS_OK;
    }
    *error = StrCat("jaxstreams: the CPU runtime pool already exists with ",
                    num_streams_, " streams and ", num_events_,
                    " events; it cannot be recreated with ", num_streams,
                    " streams and ", num_events, " events");
    return JAXSTREAMS_INVALID_ARGUMENT;
  }
  if (num_streams < 1 || num_streams > kMaxStreams) {
    *error = StrCat("jaxstreams: runtime streams must be in [1, ", kMaxStreams,
                    "], got ", num_streams);
    return JAXSTREAMS_INVALID_ARGUMENT;
  }
  if (num_events < 1 || num_events > kMaxEvents) {
    *error = StrCat("jaxstreams: runtime events must be in [1, ", kMaxEvents,
                    "], got ", num_events);
    return JAXSTREAMS_INVALID_ARGUMENT;
  }
  for (int64_t k = 0; k < num_streams; ++k) {
    streams_.push_back(
        std::make_unique<InOrderWorker>(StrCat("jaxstreams-stream-", k)));
  }
  copy_ = std::make_unique<InOrderWorker>("jaxstreams-copy");
  completion_ = std::make_unique<InOrderWorker>("jaxstreams-completion");
  events_.reset(new CpuEvent[num_events]);
  num_streams_ = num_streams;
  num_events_ = num_events;
  pool_ = true;
  return JAXSTREAMS_OK;
}

void Runtime::DestroyPool() {
  std::vector<std::unique_ptr<InOrderWorker>> streams;
  std::unique_ptr<InOrderWorker> copy;
  std::unique_ptr<InOrderWorker> completion;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pool_) return;
    streams = std::move(streams_);
    copy = std::move(copy_);
    completion = std::move(completion_);
    streams_.clear();
    pool_ = false;
    num_streams_ = num_events_ = 0;
    stages_.ForEach([](StageArea& stage) { stage.queue.Close(); });
  }
  // Joined outside the lock: queued tasks may still look things up. Events
  // stay allocated (a late waiter may still hold one).
  streams.clear();
  copy.reset();
  completion.reset();
}

bool Runtime::GetPoolSizes(int64_t* num_streams, int64_t* num_events) {
  std::lock_guard<std::mutex> lock(mu_);
  *num_streams = num_streams_;
  *num_events = num_events_;
  return pool_;
}

static ffi::Error NoPool(const char* where) {
  return MakeError(ffi::ErrorCode::kFailedPrecondition, where,
                   "the CPU runtime pool was not created; call "
                   "jaxstreams.runtime.init() (done automatically by the "
                   "Python wrappers) before running the program");
}

ffi::ErrorOr<InOrderWorker*> Runtime::Stream(const char* where, int64_t k) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pool_) return ffi::Unexpected(NoPool(where));
  if (k < 0 || k >= num_streams_) {
    return ffi::Unexpected(InvalidArgument(
        where, "runtime stream ", k, " is out of range [0, ", num_streams_,
        ") (the pool was created with ", num_streams_, " streams)"));
  }
  return streams_[static_cast<size_t>(k)].get();
}

ffi::ErrorOr<CpuEvent*> Runtime::Event(const char* where, int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pool_) return ffi::Unexpected(NoPool(where));
  if (id < 0 || id >= num_events_) {
    return ffi::Unexpected(InvalidArgument(
        where, "event ", id, " is out of range [0, ", num_events_,
        ") (the pool was created with ", num_events_, " events)"));
  }
  return &events_[id];
}

ffi::ErrorOr<InOrderWorker*> Runtime::CopyWorker(const char* where) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pool_) return ffi::Unexpected(NoPool(where));
  return copy_.get();
}

ffi::ErrorOr<InOrderWorker*> Runtime::CompletionWorker(const char* where) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pool_) return ffi::Unexpected(NoPool(where));
  return completion_.get();
}

void Runtime::Synchronize() {
  std::vector<InOrderWorker*> workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& w : streams_) workers.push_back(w.get());
    if (copy_) workers.push_back(copy_.get());
    if (completion_) workers.push_back(completion_.get());
  }
  for (InOrderWorker* w : workers) w->Synchronize();
}

JaxstreamsStatus Runtime::CreateStage(int64_t capacity, int64_t item_bytes,
                                      int64_t* id, std::string* error) {
  if (std::string bad = CheckStageSize(capacity, item_bytes); !bad.empty()) {
    *error = std::move(bad);
    return JAXSTREAMS_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!pool_) {
    *error = "jaxstreams: create the runtime pool (jaxstreams.runtime.init()) "
             "before a stage";
    return JAXSTREAMS_INVALID_ARGUMENT;
  }
  *id = stages_.Add([&](int64_t new_id) {
    return std::make_shared<StageArea>(new_id, capacity, item_bytes);
  });
  return JAXSTREAMS_OK;
}

std::shared_ptr<StageArea> Runtime::FindStage(int64_t id) {
  return stages_.Find(id);
}

bool Runtime::DestroyStage(int64_t id) {
  std::shared_ptr<StageArea> stage = stages_.Remove(id);
  if (!stage) return false;
  // Wakes blocked producers/consumers; copies in flight hold their own
  // reference, so the memory lives until the last one finished.
  stage->queue.Close();
  return true;
}

void Runtime::ResetMarkers(int64_t capacity) {
  markers_.Reset(capacity);
  epoch_ = std::chrono::steady_clock::now();
}

int64_t Runtime::NowNs() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now() - epoch_)
      .count();
}

}  // namespace jaxstreams::cpu
