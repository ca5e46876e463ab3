// Handlers of the CUDA runtime library (libjaxstreams_cuda.so), registered
// from Python for platform "CUDA" under the same target names as the CPU
// handlers in cpu/cpu_handlers.h.

#ifndef JAXSTREAMS_FFI_CUDA_CUDA_HANDLERS_H_
#define JAXSTREAMS_FFI_CUDA_CUDA_HANDLERS_H_

#include "common/errors.h"
#include "xla/ffi/api/ffi.h"

JAXSTREAMS_VISIBILITY_PUSH_DEFAULT

// jaxstreams_identity: cudaMemcpyAsync of operand to result on XLA's stream.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsIdentityCuda);

// Ordering handlers (see cpu/cpu_handlers.h for the contract): events are
// cudaEventRecord / cudaStreamWaitEvent on XLA's stream or a pool stream,
// delay is a spin kernel, markers record timing events.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsRecordCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsWaitCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsDelayCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsMarkerCuda);

// jaxstreams_stage_get: XLA's stream waits for the oldest item's ready
// event, then copies the device slot into the results.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsStageGetCuda);

JAXSTREAMS_VISIBILITY_POP

#endif  // JAXSTREAMS_FFI_CUDA_CUDA_HANDLERS_H_
