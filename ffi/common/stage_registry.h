// The stages of one runtime library by id, and the size rule every stage
// obeys (CPU and CUDA alike).

#ifndef JAXSTREAMS_FFI_COMMON_STAGE_REGISTRY_H_
#define JAXSTREAMS_FFI_COMMON_STAGE_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "common/errors.h"

namespace jaxstreams {

// The most bytes one stage may hold (capacity * item bytes).
inline constexpr int64_t kMaxStageBytes = int64_t{1} << 40;

// An empty string if a stage of `capacity` items of `item_bytes` is allowed,
// otherwise the message saying why not.
inline std::string CheckStageSize(int64_t capacity, int64_t item_bytes) {
  if (capacity < 1 || item_bytes < 1 || item_bytes > kMaxStageBytes ||
      capacity > kMaxStageBytes / item_bytes) {
    return StrCat("jaxstreams: a stage needs capacity >= 1 and item bytes >= "
                  "1 with capacity * item bytes <= ", kMaxStageBytes,
                  "; got capacity ", capacity, " and item bytes ", item_bytes);
  }
  return "";
}

// Thread-safe map from id to stage. Handlers hold their own shared_ptr, so a
// removed stage lives until the last one using it returns.
template <typename Stage>
class StageRegistry {
 public:
  explicit StageRegistry(int64_t first_id) : next_id_(first_id) {}

  // Gives the next id to `make(id)` and keeps the stage it returns.
  template <typename Make>
  int64_t Add(Make&& make) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t id = next_id_;
    std::shared_ptr<Stage> stage = make(id);
    stages_[id] = std::move(stage);
    ++next_id_;
    return id;
  }

  std::shared_ptr<Stage> Find(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = stages_.find(id);
    return it == stages_.end() ? nullptr : it->second;
  }

  // Removes the stage and returns it (nullptr if there was none).
  std::shared_ptr<Stage> Remove(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = stages_.find(id);
    if (it == stages_.end()) return nullptr;
    std::shared_ptr<Stage> stage = std::move(it->second);
    stages_.erase(it);
    return stage;
  }

  template <typename Fn>
  void ForEach(Fn&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, stage] : stages_) fn(*stage);
  }

 private:
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<Stage>> stages_;
  int64_t next_id_;
};

}  // namespace jaxstreams

#endif  // JAXSTREAMS_FFI_COMMON_STAGE_REGISTRY_H_
