// A fixed-capacity log of timing markers, shared by the CPU and CUDA
// runtimes. Capacity is set by Reset (off the execute path); when it is full,
// further markers are counted as dropped instead of growing memory.

#ifndef JAXSTREAMS_FFI_COMMON_MARKER_LOG_H_
#define JAXSTREAMS_FFI_COMMON_MARKER_LOG_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/capi_types.h"

namespace jaxstreams {

class MarkerLog {
 public:
  // Drops every marker and makes room for `capacity` new ones. Must not run
  // concurrently with Reserve (the Python side resets between steps).
  void Reset(int64_t capacity) {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.assign(static_cast<size_t>(std::max<int64_t>(capacity, 0)),
                    JaxstreamsMarker{});
    next_.store(0);
    dropped_.store(0);
  }

  // Index of a fresh entry, or -1 (and one more dropped) when full.
  int64_t Reserve() {
    int64_t i = next_.fetch_add(1);
    if (i >= static_cast<int64_t>(entries_.size())) {
      dropped_.fetch_add(1);
      return -1;
    }
    return i;
  }

  JaxstreamsMarker& at(int64_t i) { return entries_[static_cast<size_t>(i)]; }

  int64_t size() const {
    return std::min<int64_t>(next_.load(), static_cast<int64_t>(entries_.size()));
  }
  int64_t capacity() const { return static_cast<int64_t>(entries_.size()); }
  int64_t dropped() const { return dropped_.load(); }

 private:
  std::mutex mu_;
  std::vector<JaxstreamsMarker> entries_;
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> dropped_{0};
};

}  // namespace jaxstreams

#endif  // JAXSTREAMS_FFI_COMMON_MARKER_LOG_H_
