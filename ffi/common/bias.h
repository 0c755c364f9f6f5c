// The one parser of an attention-bias FFI buffer for every handler (kernels read it through
// kernels/bias.cuh).
#pragma once

#include <cstdint>
#include <string>

#include "common/ffi.h"
#include "kernels/bias.cuh"

namespace joa {

struct BiasLayout {
  const void* data = nullptr;
  BiasType type = BiasType::kNone;
  int64_t stride_b = 0, stride_h = 0, stride_s = 0;  // elements; 0 along broadcast dims
  int64_t len = 0;                                    // T: keys j >= T have no bias entry
};

// Reads a bias buffer [Bb, Hb, Sb, T] with Bb in {1, B}, Hb in {1, Hq}, Sb in {1, S}. Returns an
// error message or "".
inline std::string ParseBias(const ffi::AnyBuffer& bias, int64_t batch, int64_t q_heads, int64_t q_len,
                             BiasLayout& out) {
  auto d = bias.dimensions();
  if (d.size() != 4) return "bias must be rank 4 [B|1, Hq|1, S|1, T]";
  if ((d[0] != 1 && d[0] != batch) || (d[1] != 1 && d[1] != q_heads) || (d[2] != 1 && d[2] != q_len)) {
    return "bias dims must be [B|1, Hq|1, S|1, T]";
  }
  switch (bias.element_type()) {
    case ffi::DataType::F32: out.type = BiasType::kF32; break;
    case ffi::DataType::F16: out.type = BiasType::kF16; break;
    case ffi::DataType::BF16: out.type = BiasType::kBF16; break;
    case ffi::DataType::PRED: out.type = BiasType::kBool; break;
    default: return "bias must be f32, f16, bf16 or bool";
  }
  out.data = bias.untyped_data();
  out.len = d[3];
  out.stride_s = d[2] == 1 ? 0 : d[3];
  out.stride_h = d[1] == 1 ? 0 : d[2] * d[3];
  out.stride_b = d[0] == 1 ? 0 : d[1] * d[2] * d[3];
  return "";
}

}  // namespace joa
