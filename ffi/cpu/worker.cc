#include "cpu/worker.h"

#include <future>
#include <utility>

namespace jaxstreams::cpu {

InOrderWorker::InOrderWorker(std::string name)
    : name_(std::move(name)), thread_([this] { Loop(); }) {}

InOrderWorker::~InOrderWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void InOrderWorker::Enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void InOrderWorker::Synchronize() {
  std::promise<void> done;
  std::future<void> waited = done.get_future();
  Enqueue([&done] { done.set_value(); });
  waited.wait();
}

void InOrderWorker::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace jaxstreams::cpu
