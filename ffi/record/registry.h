// Registering handlers with a record stage. jax 0.11.2's register_ffi_target drops a bundle's
// record field (its CUDA plugin copies four stages), so we register those targets ourselves through
// the running XLA's C API, whose pointer a probe handler keeps from the first call frame it sees
// (XLA calls every handler once at registration for its metadata). docs/ffi-record-stage.md.
#pragma once

#include <string>

#include "xla/ffi/api/c_api.h"

namespace joa::record {

// The probe handler: register it with jax (platform CUDA) before the record targets; it answers
// XLA's metadata query and keeps the XLA_FFI_Api* of the call frame.
XLA_FFI_Error* ApiProbe(XLA_FFI_CallFrame* frame);

// The captured API's minor version, or -1 when the probe has not been called yet.
int ApiMinorVersion();

// Registers `name` (platform CUDA, command-buffer compatible) with execute + record stages through
// the captured API. Returns "" or why it could not.
std::string Register(const std::string& name, XLA_FFI_Handler* execute, XLA_FFI_Handler* record);

// What the record stages did in this process: kernel-node creations and argument updates (calls of
// a record stage), and falls back to stream capture with the last reason.
struct Counters {
  long creates = 0, updates = 0, fallbacks = 0;
  std::string last_fallback;
};
Counters GetCounters();

}  // namespace joa::record
