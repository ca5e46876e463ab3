// Handlers of the CPU runtime library (libjaxstreams_cpu.so).
//
// Each symbol is an XLA FFI handler with C linkage; Python loads the library
// with ctypes and registers the symbols with jax.ffi.register_ffi_target for
// platform "cpu". The target names are listed in jaxstreams/runtime/_loader.py.

#ifndef JAXSTREAMS_FFI_CPU_CPU_HANDLERS_H_
#define JAXSTREAMS_FFI_CPU_CPU_HANDLERS_H_

#include "common/errors.h"
#include "xla/ffi/api/ffi.h"

JAXSTREAMS_VISIBILITY_PUSH_DEFAULT

// jaxstreams_identity: copies its operand into its result (any dtype/shape).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsIdentityCpu);

// The ordering handlers take any number of operands and return them
// unchanged (aliased when XLA can); attribute "stream" is -1 for the caller
// or a runtime stream id.
// jaxstreams_record(event, stream): record the event on the stream.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsRecordCpu);
// jaxstreams_wait(event, stream): the stream waits for the event's latest
// record.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsWaitCpu);
// jaxstreams_delay(microseconds, stream): keep the stream busy (tests).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsDelayCpu);
// jaxstreams_marker(region, phase, track, stream): timestamp into the
// marker log.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsMarkerCpu);

// jaxstreams_stage_get(stage, timeout_ms): its results receive the oldest
// item of the stage, in order, byte for byte; its operands, if any, only
// order it after other work and are not read.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxstreamsStageGetCpu);

JAXSTREAMS_VISIBILITY_POP

#endif  // JAXSTREAMS_FFI_CPU_CPU_HANDLERS_H_
