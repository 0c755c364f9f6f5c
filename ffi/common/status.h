// Device-side error flags written to a handler's int32 status output (one word per batch row).
// Mirrors jax_onnx_attn/ops/status.py; tests/test_extension.py checks that the two agree.
#pragma once

namespace joa::status {

inline constexpr int kOk = 0;
// The rows to write fall outside [0, capacity): the write for that batch row was skipped.
inline constexpr int kKvWriteOutOfRange = 1;

}  // namespace joa::status
