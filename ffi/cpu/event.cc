#include "cpu/event.h"

#include <utility>

namespace jaxstreams::cpu {

uint64_t CpuEvent::Begin() {
  std::lock_guard<std::mutex> lock(mu_);
  return ++recorded_;
}

uint64_t CpuEvent::RecordOn(InOrderWorker& worker) {
  uint64_t gen = Begin();
  worker.Enqueue([this, gen] { Complete(gen); });
  return gen;
}

uint64_t CpuEvent::RecordAfter(InOrderWorker& worker,
                               std::function<void()> after) {
  uint64_t gen = Begin();
  worker.Enqueue([this, gen, after = std::move(after)] {
    after();
    Complete(gen);
  });
  return gen;
}

uint64_t CpuEvent::RecordNow() {
  uint64_t gen = Begin();
  Complete(gen);
  return gen;
}

uint64_t CpuEvent::Latest() const {
  std::lock_guard<std::mutex> lock(mu_);
  return recorded_;
}

bool CpuEvent::Done(uint64_t gen) const {
  std::lock_guard<std::mutex> lock(mu_);
  return gen <= watermark_;
}

void CpuEvent::Complete(uint64_t gen) {
  std::vector<std::function<void()>> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    early_.insert(gen);
    while (!early_.empty() && *early_.begin() == watermark_ + 1) {
      early_.erase(early_.begin());
      ++watermark_;
    }
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->first <= watermark_) {
        ready.push_back(std::move(it->second));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  cv_.notify_all();
  for (auto& fn : ready) fn();
}

void CpuEvent::WhenComplete(uint64_t gen, std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (gen > watermark_) {
      waiters_.emplace_back(gen, std::move(fn));
      return;
    }
  }
  fn();
}

void CpuEvent::BlockUntil(uint64_t gen) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return watermark_ >= gen; });
}

}  // namespace jaxstreams::cpu
