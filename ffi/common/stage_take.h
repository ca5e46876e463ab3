// The consumer side of a stage that the CPU and CUDA jaxstreams_stage_get
// handlers share: checking the program's results against the stage and
// taking the oldest queued slot.

#ifndef JAXSTREAMS_FFI_COMMON_STAGE_TAKE_H_
#define JAXSTREAMS_FFI_COMMON_STAGE_TAKE_H_

#include <cstdint>

#include "common/errors.h"
#include "common/passthrough.h"
#include "common/slot_queue.h"
#include "xla/ffi/api/ffi.h"

namespace jaxstreams {

// The slot of the oldest item of stage `stage_id` (item_bytes per item,
// queued in `queue`), once the results `rets` were checked to hold exactly
// one item; waits at most timeout_ms for a put. The caller releases the slot.
inline ::xla::ffi::ErrorOr<int64_t> TakeStageItem(
    const char* where, int64_t stage_id, int64_t item_bytes, SlotQueue& queue,
    ::xla::ffi::RemainingRets rets, int64_t timeout_ms) {
  namespace ffi = ::xla::ffi;
  ffi::ErrorOr<size_t> total = TotalBytes(rets);
  if (total.has_error()) return ffi::Unexpected(total.error());
  if (static_cast<int64_t>(*total) != item_bytes) {
    return ffi::Unexpected(InvalidArgument(
        where, "stage ", stage_id, " holds items of ", item_bytes,
        " bytes but the program asks for ", *total, " bytes of results"));
  }
  int64_t slot = -1;
  switch (queue.TakeQueued(timeout_ms, &slot)) {
    case SlotWait::kOk:
      return slot;
    case SlotWait::kTimeout:
      return ffi::Unexpected(MakeError(ffi::ErrorCode::kDeadlineExceeded, where,
                                       "no item was put into stage ", stage_id,
                                       " within ", timeout_ms, " ms"));
    case SlotWait::kClosed:
      break;
  }
  return ffi::Unexpected(MakeError(ffi::ErrorCode::kOutOfRange, where, "stage ",
                                   stage_id, " is closed and has no more items"));
}

}  // namespace jaxstreams

#endif  // JAXSTREAMS_FFI_COMMON_STAGE_TAKE_H_
