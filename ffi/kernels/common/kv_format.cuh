// How an engine reads a KV cache into shared memory, as policy types (like the score variants of
// variant.cuh); the decode engine's cp.async ring uses them, and a tiled prefill engine can.
//
// DenseKv<T>: the cache holds T; tiles stream straight into the ring the MMAs read.
// QuantKv<T, 8>: int8 [B, Hkv, C, D]. QuantKv<T, 4>: uint8 [B, Hkv, C, D / 2] (the layout of
//   kv_quant.cuh, which the writer uses too). Both stream the raw bytes (half / a quarter of a dense
//   tile) through the cp.async ring, so the same shared memory keeps more tiles in flight. Once a
//   tile has landed the CTA converts it into one T tile pair laid out like a dense stage, which the
//   unchanged MMA code reads. A value is T(float(q) * scale), the f32 product rounded once to T, with
//   a scale of 0 read as 1: jax_onnx_attn/ops/reference/quant.dequantize. Scales are f32, one per
//   tensor or one per (KV head, channel).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/kv_quant.cuh"
#include "kernels/common/params.h"
#include "kernels/ptx.cuh"

namespace joa {

template <typename T>
struct DenseKv {
  static constexpr bool kQuantized = false;
  static constexpr int kBits = 8 * int(sizeof(T));
};

template <typename T, int kBits_>
struct QuantKv {
  using Layout = KvQuantLayout<kBits_ == 8 ? KvFormat::kInt8 : KvFormat::kInt4>;
  static constexpr bool kQuantized = true;
  static constexpr int kBits = kBits_;

  // Bytes of one cache row of kD values (rows are contiguous in the ring, unpadded: only the
  // convert step reads them, with conflict-free consecutive accesses).
  template <int kD>
  static constexpr int RowBytes() { return Layout::template RowBytes<kD>(); }

  // The f32 scales of KV head kvh into s_scale[0, kD) (K) and [kD, 2 kD) (V), 0 read as 1.
  template <int kD, int kThreads>
  static __device__ __forceinline__ void LoadScales(float* s_scale, const KvScales& sc, int kvh, int tid) {
    // Per tensor: every channel reads element 0.
    const int k_step = sc.k_per_channel ? 1 : 0, v_step = sc.v_per_channel ? 1 : 0;
    for (int d = tid; d < kD; d += kThreads) {
      const float ks = sc.k[(kvh * kD + d) * k_step], vs = sc.v[(kvh * kD + d) * v_step];
      s_scale[d] = ScaleOrOne(ks);
      s_scale[kD + d] = ScaleOrOne(vs);
    }
  }

  // cp.async of rows [0, kRows) of K and V (row i at k_src / v_src + i * stride bytes) into a ring
  // stage: K rows then V rows, RowBytes apart; rows outside [valid_lo, valid_hi) are zero-filled
  // and not read.
  template <int kD, int kRows, int kThreads>
  static __device__ __forceinline__ void LoadTile(unsigned char* dst, const unsigned char* k_src,
                                                  const unsigned char* v_src, int64_t k_stride,
                                                  int64_t v_stride, int valid_lo, int valid_hi, int tid) {
    LoadRawRows<RowBytes<kD>(), kRows, kThreads>(dst, k_src, k_stride, valid_lo, valid_hi, tid);
    LoadRawRows<RowBytes<kD>(), kRows, kThreads>(dst + kRows * RowBytes<kD>(), v_src, v_stride,
                                                 valid_lo, valid_hi, tid);
  }

  // Converts a landed ring stage (src: K rows then V rows) into the T tile pair at dst (K, then V
  // kRows * kStride elements on; row stride kStride, as a dense stage). Rows outside
  // [valid_lo, valid_hi) become zeros, as the dense loads zero-fill them. A thread keeps one
  // 8-column slice (so its 16 scales are read once) and walks the rows.
  template <int kD, int kRows, int kThreads, int kStride>
  static __device__ __forceinline__ void ConvertTile(T* dst, const unsigned char* src,
                                                     const float* s_scale, int valid_lo,
                                                     int valid_hi, int tid) {
    constexpr int kSlices = kD / 8;                       // 8 values -> one 16-byte store of T
    constexpr int kRowStep = kThreads / kSlices;          // rows converted side by side
    static_assert(kRowStep >= 1, "a thread per 8-column slice of a row");
    constexpr int kIters = (kRows + kRowStep - 1) / kRowStep;
    constexpr int kSliceBytes = Layout::kBytes8;
    // D 80 / 96: 128 or 256 threads are not whole rows of slices; the remainder idles.
    if (kThreads % kSlices != 0 && tid >= kRowStep * kSlices) return;
    const int slice = tid % kSlices, r0 = tid / kSlices;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      float sc[8];
      const float4* s4 = reinterpret_cast<const float4*>(s_scale + kv * kD + slice * 8);
      const float4 s_lo = s4[0], s_hi = s4[1];
      sc[0] = s_lo.x; sc[1] = s_lo.y; sc[2] = s_lo.z; sc[3] = s_lo.w;
      sc[4] = s_hi.x; sc[5] = s_hi.y; sc[6] = s_hi.z; sc[7] = s_hi.w;
      const unsigned char* s = src + kv * kRows * RowBytes<kD>() + slice * kSliceBytes;
      T* d = dst + kv * kRows * kStride + slice * 8;
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        const int r = r0 + i * kRowStep;
        if (kRows % kRowStep == 0 || r < kRows) {
          uint4 y = make_uint4(0u, 0u, 0u, 0u);
          if (r >= valid_lo && r < valid_hi) y = Dequant8(s + r * RowBytes<kD>(), sc);
          *reinterpret_cast<uint4*>(d + r * kStride) = y;
        }
      }
    }
  }

 private:
  template <int kRowBytes, int kRows, int kThreads>
  static __device__ __forceinline__ void LoadRawRows(unsigned char* dst, const unsigned char* src,
                                                     int64_t row_stride, int valid_lo, int valid_hi,
                                                     int tid) {
    // 16-byte copies, or 8 where a row is not whole 16-byte chunks (int4 at D = 80: 40 bytes).
    constexpr int kCopy = kRowBytes % 16 == 0 ? 16 : 8;
    static_assert(kRowBytes % kCopy == 0, "rows must be whole 8-byte chunks");
    constexpr int kPerRow = kRowBytes / kCopy;
    constexpr int kTotal = kRows * kPerRow;
    constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = tid + it * kThreads;
      if (kTotal % kThreads == 0 || c < kTotal) {
        const int r = c / kPerRow;
        const int col = (c % kPerRow) * kCopy;
        const bool valid = r >= valid_lo && r < valid_hi;
        const unsigned char* g = valid ? src + r * row_stride + col : src;
        const uint32_t s = ptx::SmemAddr(dst + r * kRowBytes + col);
        if constexpr (kCopy == 16) {
          ptx::CpAsync16(s, g, valid);
        } else {
          ptx::CpAsync8(s, g, valid);
        }
      }
    }
  }

  // 8 consecutive values of one row at raw (8 bytes int8 / 4 bytes int4) -> 8 T in one uint4,
  // each T(float(q) * sc[c]).
  static __device__ __forceinline__ uint4 Dequant8(const unsigned char* raw, const float (&sc)[8]) {
    float x[8];
    Layout::Load8(raw, x);
    uint4 y;
    y.x = ptx::Pack2<T>(x[0] * sc[0], x[1] * sc[1]);
    y.y = ptx::Pack2<T>(x[2] * sc[2], x[3] * sc[3]);
    y.z = ptx::Pack2<T>(x[4] * sc[4], x[5] * sc[5]);
    y.w = ptx::Pack2<T>(x[6] * sc[6], x[7] * sc[7]);
    return y;
  }
};

// The policy of a KvFormat (params.h).
template <typename T, KvFormat kFormat>
struct KvPolicyOf;
template <typename T>
struct KvPolicyOf<T, KvFormat::kDense> {
  using type = DenseKv<T>;
};
template <typename T>
struct KvPolicyOf<T, KvFormat::kInt8> {
  using type = QuantKv<T, 8>;
};
template <typename T>
struct KvPolicyOf<T, KvFormat::kInt4> {
  using type = QuantKv<T, 4>;
};
template <typename T, KvFormat kFormat>
using KvPolicy = typename KvPolicyOf<T, kFormat>::type;

}  // namespace joa
