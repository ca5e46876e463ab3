/* The plain C API each runtime library exports, for jaxstreams/runtime/_capi.py
 * (ctypes). PREFIX is JaxstreamsCpu or JaxstreamsCuda; the signatures are the
 * same for both, so Python binds them with one table.
 *
 * Every function that can fail returns a JaxstreamsStatus and writes a
 * message of at most errlen-1 bytes to err. Both libraries define these
 * functions with JAXSTREAMS_DEFINE_CAPI (common/capi_impl.h). */

#ifndef JAXSTREAMS_FFI_COMMON_CAPI_H_
#define JAXSTREAMS_FFI_COMMON_CAPI_H_

#include <stdint.h>

#include "common/capi_types.h"
#include "common/errors.h"

#define JAXSTREAMS_DECLARE_CAPI(PREFIX)                                        \
  extern "C" {                                                                 \
  JAXSTREAMS_EXPORT int PREFIX##AbiVersion(void);                              \
  /* XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR of the headers built with. */ \
  JAXSTREAMS_EXPORT int PREFIX##FfiApiVersion(void);                           \
  /* Creates device's pool of runtime streams and events once. */            \
  JAXSTREAMS_EXPORT int PREFIX##PoolCreate(int64_t device, int64_t streams,    \
                                           int64_t events, char* err,          \
                                           int64_t errlen);                    \
  /* 1 and the sizes if device's pool exists, else 0. */                      \
  JAXSTREAMS_EXPORT int PREFIX##PoolInfo(int64_t device, int64_t* streams,     \
                                         int64_t* events);                     \
  /* Releases every pool (process exit). */                                   \
  JAXSTREAMS_EXPORT void PREFIX##PoolDestroyAll(void);                         \
  /* Waits until all work queued on device's runtime streams ran. */          \
  JAXSTREAMS_EXPORT int PREFIX##Synchronize(int64_t device, char* err,         \
                                            int64_t errlen);                   \
  JAXSTREAMS_EXPORT int PREFIX##StageCreate(int64_t device, int64_t capacity,  \
                                            int64_t item_bytes, int64_t* id,   \
                                            char* err, int64_t errlen);        \
  /* Copies n host buffers (item_bytes in all) into a free slot and starts   \
   * its transfer on the copy stream; delay_us > 0 makes the copy stream     \
   * slow first (tests). */                                                   \
  JAXSTREAMS_EXPORT int PREFIX##StagePut(                                      \
      int64_t id, int64_t n, const void* const* ptrs, const int64_t* sizes,    \
      int64_t timeout_ms, int64_t delay_us, char* err, int64_t errlen);        \
  JAXSTREAMS_EXPORT int PREFIX##StageClose(int64_t id);                        \
  JAXSTREAMS_EXPORT int PREFIX##StageDestroy(int64_t id);                      \
  JAXSTREAMS_EXPORT int PREFIX##StageStats(int64_t id,                         \
                                           JaxstreamsStageStats* out);         \
  /* Drops device's markers and makes room for capacity new ones. */          \
  JAXSTREAMS_EXPORT int PREFIX##TimelineReset(int64_t device,                  \
                                              int64_t capacity, char* err,     \
                                              int64_t errlen);                 \
  /* Waits for device's markers and copies up to max of them to out. */       \
  JAXSTREAMS_EXPORT int PREFIX##TimelineRead(                                  \
      int64_t device, JaxstreamsMarker* out, int64_t max, int64_t* count,      \
      int64_t* dropped, char* err, int64_t errlen);                            \
  }

#endif /* JAXSTREAMS_FFI_COMMON_CAPI_H_ */
