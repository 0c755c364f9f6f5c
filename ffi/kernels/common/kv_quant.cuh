// The one layout of a quantised KV cache, written by gqa_prepare (quantise on write) and read by the
// decode engine (kv_format.cuh). Semantics: jax_onnx_attn/ops/reference/quant.py.
//
// int8: int8 [.., D], a value q in [-128, 127]. int4: uint8 [.., D / 2], two values a byte, column
// 2i in the low nibble and 2i + 1 in the high one, each stored as q + 8 (q in [-8, 7]). A value reads
// as float(q) * scale with a scale of 0 read as 1, and is written as q = clamp(rint(x * (1 / scale)))
// with the reciprocal in IEEE f32. Both sides move 8 consecutive values of a row at a time (8 bytes
// of int8, 4 of int4).
#pragma once

#include <cstdint>

#include "kernels/common/params.h"

namespace joa {

// A dequantisation scale as both sides use it: 0 reads as 1.
__device__ __forceinline__ float ScaleOrOne(float s) { return s == 0.f ? 1.f : s; }

template <KvFormat kFormat>
struct KvQuantLayout {
  static_assert(kFormat == KvFormat::kInt8 || kFormat == KvFormat::kInt4, "int8 or int4 caches");
  static constexpr int kBits = KvBits(kFormat);
  static constexpr float kQMax = kBits == 8 ? 127.f : 7.f;
  static constexpr float kQMin = -kQMax - 1.f;
  static constexpr int kBytes8 = kBits;  // bytes of 8 consecutive values

  // Bytes of a row of kD values.
  template <int kD>
  static constexpr int RowBytes() { return kD * kBits / 8; }

  // The level of x: clamp(round_half_even(x * inv_scale)), inv_scale = 1 / ScaleOrOne(scale).
  static __device__ __forceinline__ int Quantize(float x, float inv_scale) {
    return int(fminf(fmaxf(rintf(__fmul_rn(x, inv_scale)), kQMin), kQMax));
  }

  // Writes 8 consecutive levels of a row at dst (kBytes8 bytes, aligned to them).
  static __device__ __forceinline__ void Store8(void* dst, const int (&q)[8]) {
    if constexpr (kBits == 8) {
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        lo |= uint32_t(uint8_t(q[i])) << (8 * i);
        hi |= uint32_t(uint8_t(q[i + 4])) << (8 * i);
      }
      *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
    } else {
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const uint32_t byte = uint32_t((q[i] + 8) & 15) | (uint32_t((q[i + 1] + 8) & 15) << 4);
        word |= byte << (4 * i);
      }
      *reinterpret_cast<uint32_t*>(dst) = word;
    }
  }

  // Reads 8 consecutive levels of a row at raw (kBytes8 bytes, aligned to them) as exact floats.
  // Integer -> f32 through the mantissa of 2^23 (exact, and cheaper than I2F).
  static __device__ __forceinline__ void Load8(const unsigned char* raw, float (&x)[8]) {
    if constexpr (kBits == 8) {
      const uint2 w = *reinterpret_cast<const uint2*>(raw);
      const uint32_t u0 = w.x ^ 0x80808080u, u1 = w.y ^ 0x80808080u;  // q + 128 per byte
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[i] = Magic(u0, i) - 8388736.f;  // 2^23 + 128
        x[4 + i] = Magic(u1, i) - 8388736.f;
      }
    } else {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(raw);
      const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;  // q + 8: columns 2i, 2i + 1
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[2 * i] = Magic(lo, i) - 8388616.f;  // 2^23 + 8
        x[2 * i + 1] = Magic(hi, i) - 8388616.f;
      }
    }
  }

 private:
  // 2^23 + u as an f32 (exact for a byte u): the byte dropped into the mantissa of 2^23.
  static __device__ __forceinline__ float Magic(uint32_t bytes, int i) {
    return __uint_as_float(__byte_perm(bytes, 0x4B000000u, 0x7650u | unsigned(i)));
  }
};

}  // namespace joa
