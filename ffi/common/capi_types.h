/* Types of the plain C API that jaxstreams/runtime/_capi.py calls through
 * ctypes (the FFI handlers themselves are registered separately). Mirrored by
 * ctypes.Structure classes in Python: change both together and bump
 * JAXSTREAMS_FFI_ABI_VERSION (common/version.h). */

#ifndef JAXSTREAMS_FFI_COMMON_CAPI_TYPES_H_
#define JAXSTREAMS_FFI_COMMON_CAPI_TYPES_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Return codes of the C API. A nonzero code comes with a message written to
 * the caller's error buffer. */
enum JaxstreamsStatus {
  JAXSTREAMS_OK = 0,
  JAXSTREAMS_TIMEOUT = 1,          /* a bounded wait ran out (stage full) */
  JAXSTREAMS_CLOSED = 2,           /* the stage was closed */
  JAXSTREAMS_INVALID_ARGUMENT = 3, /* bad id, size, count or configuration */
  JAXSTREAMS_NOT_FOUND = 4,        /* no such pool or stage */
  JAXSTREAMS_INTERNAL = 5          /* the platform (CUDA) failed */
};

/* One timing marker. CPU: t_ns from the steady clock since the last reset.
 * CUDA: t_ns from cudaEventElapsedTime since the device's first marker after
 * the last reset. Only differences within one device are meaningful. */
typedef struct JaxstreamsMarker {
  int64_t t_ns;
  int64_t region; /* caller's region id */
  int32_t phase;  /* 0 = begin, 1 = end, other = instant */
  int32_t track;  /* timeline track, usually the jaxstreams stream id */
  int32_t device; /* device ordinal (0 on CPU) */
  int32_t stream; /* -1: XLA's stream; k: runtime stream k */
} JaxstreamsMarker;

/* Counters of one stage area, for tests and for the user's diagnostics. */
typedef struct JaxstreamsStageStats {
  int64_t capacity;    /* slots, fixed at creation */
  int64_t item_bytes;  /* bytes per item, fixed at creation */
  int64_t puts;        /* items handed to the copy stream */
  int64_t gets;        /* items handed to a consumer */
  int64_t queued;      /* items put and not yet taken */
  int64_t free_slots;  /* slots a put could use now */
  int64_t allocations; /* buffer allocations made (constant after creation) */
  int64_t last_slot;   /* slot index of the most recent get, -1 if none */
  int32_t closed;
  int32_t device;
} JaxstreamsStageStats;

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* JAXSTREAMS_FFI_COMMON_CAPI_TYPES_H_ */
