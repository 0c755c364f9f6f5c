// The variant of an attention call from its FFI attributes and buffers, for every handler that
// drives an attention engine (kernels/common/variant.cuh reads what this fills). Host only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/ffi.h"
#include "kernels/common/params.h"

namespace joa {

// The static attributes that select the variant, as the handlers receive them.
struct VariantAttrs {
  float scale, softcap;
  bool causal;
  int64_t left, right;
  int64_t pos_shift;  // query row i sits at kv_len - S + i + pos_shift
};

// The variant of attrs without bias or sink; positions and windows clamped to +-2^30, so the
// engines' 32-bit position arithmetic never wraps.
inline VariantParams MakeVariant(const VariantAttrs& a) {
  constexpr int64_t kMax = int64_t(1) << 30;
  VariantParams v{};
  v.scale = a.scale;
  v.softcap = a.softcap;
  v.causal = a.causal;
  v.pos_shift = int(std::max<int64_t>(-kMax, std::min<int64_t>(a.pos_shift, kMax)));
  v.left = int(std::max<int64_t>(-1, std::min<int64_t>(a.left, kMax)));
  v.right = int(std::max<int64_t>(-1, std::min<int64_t>(a.right, kMax)));
  v.bias = nullptr;
  v.bias_type = BiasType::kNone;
  v.bias_stride_b = v.bias_stride_h = v.bias_stride_s = 0;
  v.bias_len = 0;
  v.sink = nullptr;
  return v;
}

// Points v at a bias buffer [Bb, Hb, Sb, T] with Bb in {1, B}, Hb in {1, Hq}, Sb in {1, S}: the
// strides the kernels index it by (0 along broadcast dims) and its length T (keys j >= T are
// hidden). Returns an error message or "".
inline std::string SetBias(VariantParams& v, const ffi::AnyBuffer& bias, int64_t batch, int64_t q_heads,
                           int64_t q_len) {
  auto d = bias.dimensions();
  if (d.size() != 4) return "bias must be rank 4 [B|1, Hq|1, S|1, T]";
  if ((d[0] != 1 && d[0] != batch) || (d[1] != 1 && d[1] != q_heads) || (d[2] != 1 && d[2] != q_len)) {
    return "bias dims must be [B|1, Hq|1, S|1, T]";
  }
  switch (bias.element_type()) {
    case ffi::DataType::F32: v.bias_type = BiasType::kF32; break;
    case ffi::DataType::F16: v.bias_type = BiasType::kF16; break;
    case ffi::DataType::BF16: v.bias_type = BiasType::kBF16; break;
    case ffi::DataType::PRED: v.bias_type = BiasType::kBool; break;
    default: return "bias must be f32, f16, bf16 or bool";
  }
  v.bias = bias.untyped_data();
  v.bias_len = int(std::min<int64_t>(d[3], int64_t(1) << 30));
  v.bias_stride_s = d[2] == 1 ? 0 : d[3];
  v.bias_stride_h = d[1] == 1 ? 0 : d[2] * d[3];
  v.bias_stride_b = d[0] == 1 ? 0 : d[1] * d[2] * d[3];
  return "";
}

// Points v at a sink buffer f32 [Hq]. Returns an error message or "".
inline std::string SetSink(VariantParams& v, const ffi::Buffer<ffi::F32>& sink, int64_t q_heads) {
  if (sink.dimensions().size() != 1 || sink.dimensions()[0] != q_heads) return "sink must be f32 [Hq]";
  v.sink = sink.typed_data();
  return "";
}

}  // namespace joa
