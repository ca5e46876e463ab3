// A CPU event with CUDA event semantics. Each Record() starts a new
// generation that completes when the recording "stream" reaches it; a wait
// captures the latest generation recorded at that moment and is satisfied
// once every generation up to it has completed (records on different workers
// may complete out of order). Never recorded: a wait is satisfied at once.

#ifndef JAXSTREAMS_FFI_CPU_EVENT_H_
#define JAXSTREAMS_FFI_CPU_EVENT_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "cpu/worker.h"

namespace jaxstreams::cpu {

class CpuEvent {
 public:
  // Starts a generation that completes after the tasks already queued on
  // `worker`; returns it.
  uint64_t RecordOn(InOrderWorker& worker);
  // Starts a generation that completes `after` the given callable runs on
  // `worker` (used by the copy stream: copy, then complete).
  uint64_t RecordAfter(InOrderWorker& worker, std::function<void()> after);
  // Starts and completes a generation now (a record on the caller's stream:
  // everything before the handler is already done on CPU).
  uint64_t RecordNow();

  // Latest generation recorded so far; what a wait issued now waits for.
  uint64_t Latest() const;
  // True when generation `gen` and all before it completed.
  bool Done(uint64_t gen) const;

  // Runs `fn` once generation `gen` and all before it completed; at once if
  // they already have. `fn` may run on a worker thread.
  void WhenComplete(uint64_t gen, std::function<void()> fn);

  // Blocks the caller until generation `gen` completed.
  void BlockUntil(uint64_t gen);

 private:
  uint64_t Begin();
  void Complete(uint64_t gen);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t recorded_ = 0;   // generations started
  uint64_t watermark_ = 0;  // every generation <= watermark_ completed
  std::set<uint64_t> early_;  // completed above the watermark
  std::vector<std::pair<uint64_t, std::function<void()>>> waiters_;
};

}  // namespace jaxstreams::cpu

#endif  // JAXSTREAMS_FFI_CPU_EVENT_H_
