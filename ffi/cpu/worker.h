// An in-order worker thread: the CPU runtime's stand-in for a CUDA stream.
// Tasks run one at a time in the order they were enqueued, on a thread the
// runtime owns, so "record an event on stream k after the work before it"
// means exactly what it means on a GPU.

#ifndef JAXSTREAMS_FFI_CPU_WORKER_H_
#define JAXSTREAMS_FFI_CPU_WORKER_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace jaxstreams::cpu {

class InOrderWorker {
 public:
  explicit InOrderWorker(std::string name);
  ~InOrderWorker();  // Runs what is queued, then joins the thread.

  InOrderWorker(const InOrderWorker&) = delete;
  InOrderWorker& operator=(const InOrderWorker&) = delete;

  void Enqueue(std::function<void()> task);

  // Blocks until every task enqueued before this call has run.
  void Synchronize();

  const std::string& name() const { return name_; }

 private:
  void Loop();

  const std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace jaxstreams::cpu

#endif  // JAXSTREAMS_FFI_CPU_WORKER_H_
