// The XLA FFI record stage (jaxlib >= 0.11.2 headers: xla/ffi/api/record_api.h): instead of XLA
// stream-capturing a handler into a child graph of its command buffer, the handler hands XLA its
// kernels and XLA adds them as kernel nodes, with programmatic-dependent-launch edges to and from
// its neighbours. Our GEMV kernels read their weights before griddepcontrol.wait, so with those
// edges a projection streams its weights while the previous kernel finishes
// (tools/probes/ffi_record: an 8 MB weight stream 4.09 -> 2.17 µs a call on the H200).
// docs/ffi-record-stage.md says how it is registered and what it assumes.
//
// A handler gets its record stage from its execute implementation: Stage<Impl>::Record runs Impl
// with a LaunchRecorder active (common/launch.h), so the plan, the checks and the kernel parameters
// are the execute stage's own, then emits the recorded launches.
#pragma once

#if JOA_HAVE_FFI_RECORD

#include <cuda_runtime.h>

#include "common/ffi.h"
#include "common/launch.h"
#include "xla/ffi/api/record_api.h"

namespace joa::record {

using Context = ffi::internal::RecordContextBase<ffi::internal::ErrorPolicy>;
// jaxlib 0.11.2 has no public alias for the record extension; this is the one its tests define.
struct RecordExtension : ffi::internal::RecordExtensionBase<Context> {};
using RecordCtx = ffi::Extension<RecordExtension>;

// Hands XLA the recorded launches: kernel nodes on create, their new arguments on update (buffer
// addresses changed), or a request to stream-capture the execute stage instead when a launch needs
// what a node cannot carry (a function attribute, a kernel without an embedded image).
ffi::Error Emit(Context& rec, const LaunchRecorder& recorder);

template <auto Impl>
struct Stage;

// The record stage of a handler whose execute stage is Impl(cudaStream_t, Args...).
template <typename... Args, ffi::Error (*Impl)(cudaStream_t, Args...)>
struct Stage<Impl> {
  static ffi::Error Record(Context rec, Args... args) {
    LaunchRecorder recorder;
    if (ffi::Error e = Impl(cudaStream_t{}, args...); e.failure()) return e;
    return Emit(rec, recorder);
  }
};

}  // namespace joa::record

#endif  // JOA_HAVE_FFI_RECORD
