// Host-side bookkeeping of a stage area's slots, shared by the CPU and CUDA
// runtimes: which slots are free, which hold an item that was put (in put
// order), closing, and bounded waits. It never touches the slots' memory; the
// platform code does that and orders it with its own events.
//
// All storage is sized at construction, so the put/get paths never allocate
// and memory never grows with steps.

#ifndef JAXSTREAMS_FFI_COMMON_SLOT_QUEUE_H_
#define JAXSTREAMS_FFI_COMMON_SLOT_QUEUE_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

namespace jaxstreams {

enum class SlotWait { kOk, kTimeout, kClosed };

class SlotQueue {
 public:
  explicit SlotQueue(int64_t capacity)
      : capacity_(capacity), free_(capacity), queued_(capacity) {
    for (int64_t i = 0; i < capacity; ++i) free_.Push(i);
  }

  int64_t capacity() const { return capacity_; }

  // Takes a free slot for a producer, waiting up to `timeout_ms` (< 0: no
  // limit) while all slots are in use.
  SlotWait AcquireFree(int64_t timeout_ms, int64_t* slot) {
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [&] { return closed_ || !free_.Empty(); };
    if (!WaitFor(lock, timeout_ms, ready)) return SlotWait::kTimeout;
    if (closed_) return SlotWait::kClosed;
    *slot = free_.Pop();
    return SlotWait::kOk;
  }

  // Returns a slot taken by AcquireFree unused (the producer failed).
  void ReturnFree(int64_t slot) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.Push(slot);
    cv_.notify_all();
  }

  // Makes a filled (or filling, on an ordered copy stream) slot visible to
  // consumers, after every slot published before it.
  void Publish(int64_t slot) {
    std::lock_guard<std::mutex> lock(mu_);
    queued_.Push(slot);
    ++puts_;
    cv_.notify_all();
  }

  // Takes the oldest published slot for a consumer, waiting up to
  // `timeout_ms` (< 0: no limit). A closed queue still hands out what was put
  // before it was closed, then reports kClosed.
  SlotWait TakeQueued(int64_t timeout_ms, int64_t* slot) {
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [&] { return closed_ || !queued_.Empty(); };
    if (!WaitFor(lock, timeout_ms, ready)) return SlotWait::kTimeout;
    if (queued_.Empty()) return SlotWait::kClosed;
    *slot = queued_.Pop();
    ++gets_;
    last_slot_ = *slot;
    return SlotWait::kOk;
  }

  // Gives a consumed slot back to producers.
  void Release(int64_t slot) { ReturnFree(slot); }

  // Wakes every waiter; later puts fail, gets drain what is queued.
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }

  bool closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_;
  }

  struct Counters {
    int64_t puts, gets, queued, free_slots, last_slot;
    bool closed;
  };
  Counters counters() const {
    std::lock_guard<std::mutex> lock(mu_);
    return {puts_, gets_, queued_.Size(), free_.Size(), last_slot_, closed_};
  }

 private:
  // A ring of slot indices with room for every slot.
  class Ring {
   public:
    explicit Ring(int64_t capacity) : items_(capacity > 0 ? capacity : 1) {}
    bool Empty() const { return size_ == 0; }
    int64_t Size() const { return size_; }
    void Push(int64_t v) {
      items_[(head_ + size_) % items_.size()] = v;
      ++size_;
    }
    int64_t Pop() {
      int64_t v = items_[head_];
      head_ = (head_ + 1) % items_.size();
      --size_;
      return v;
    }

   private:
    std::vector<int64_t> items_;
    size_t head_ = 0;
    int64_t size_ = 0;
  };

  template <typename Pred>
  bool WaitFor(std::unique_lock<std::mutex>& lock, int64_t timeout_ms,
               Pred pred) {
    if (timeout_ms < 0) {
      cv_.wait(lock, pred);
      return true;
    }
    return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), pred);
  }

  const int64_t capacity_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Ring free_;
  Ring queued_;
  bool closed_ = false;
  int64_t puts_ = 0;
  int64_t gets_ = 0;
  int64_t last_slot_ = -1;
};

}  // namespace jaxstreams

#endif  // JAXSTREAMS_FFI_COMMON_SLOT_QUEUE_H_
