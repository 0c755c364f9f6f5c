// The GroupQueryAttention step-preparation kernel (handler: ffi/handlers/gqa_prepare.cu):
// split (packed or separate Q, K, V), per-head RMS norm of Q and K, rotary, then Q to its output
// and K / V to cache row past_b + s (quantised in the layout of kernels/common/kv_quant.cuh).
// Semantics: jax_onnx_attn/ops/reference/gqa.py `prepare_step`.
//
// Rounding follows the spec: the norm's output and the rotary's output are rounded to T, and a
// quantised row is quantised from those T values.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/status.h"
#include "kernels/common/kv_quant.cuh"
#include "kernels/common/rotary.cuh"
#include "kernels/common/params.h"
#include "kernels/convert.cuh"

namespace joa::gqa {
// Internal linkage, as when the kernel lived in its handler's file: one TU (the handler) includes this.
namespace {

inline constexpr int kChunk = 8;          // elements of a head row each lane owns (16 bytes of f16 / bf16)
inline constexpr int kMaxLanes = 32;      // a row is handled by at most one warp ...
inline constexpr int kMaxHeadDim = kChunk * kMaxLanes;  // ... so D <= 256
inline constexpr int kThreads = 128;

struct PrepareParams {
  const void* query;
  const void* key;
  const void* value;
  const int32_t* seqlens;
  const void* cos;
  const void* sin;
  const int32_t* position_ids;  // nullptr: positions past_b + s
  const void* q_norm;           // nullptr: no q/k norm
  const void* k_norm;
  const float* k_scale;
  const float* v_scale;
  void* q_out;
  void* k_cache;
  void* v_cache;
  int32_t* status;
  int batch, seq, heads, kv_heads, head_dim, capacity;
  int rotary_half;    // R / 2; 0: no rotary
  int max_position;   // rows of the cos / sin tables
  bool packed, interleaved, k_per_channel, v_per_channel;
  float q_eps, k_eps;
};

// kChunk elements from 16-byte aligned memory (D, R/2 and the row starts are multiples of 8).
template <typename T>
__device__ __forceinline__ void LoadChunk(const void* src, float (&x)[kChunk]) {
  alignas(16) T v[kChunk];
#pragma unroll
  for (int i = 0; i < int(sizeof(v) / 16); ++i) {
    reinterpret_cast<uint4*>(v)[i] = static_cast<const uint4*>(src)[i];
  }
#pragma unroll
  for (int i = 0; i < kChunk; ++i) x[i] = ToFloat(v[i]);
}

template <typename T>
__device__ __forceinline__ void StoreChunk(void* dst, const float (&x)[kChunk]) {
  alignas(16) T v[kChunk];
#pragma unroll
  for (int i = 0; i < kChunk; ++i) v[i] = FromFloat<T>(x[i]);
#pragma unroll
  for (int i = 0; i < int(sizeof(v) / 16); ++i) {
    static_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(v)[i];
  }
}

// Writes one lane's kChunk values of row `cache_row` of a K or V cache of D-feature rows: T, or
// quantised in the layout of kernels/common/kv_quant.cuh (the one the decode engine reads).
template <typename T, KvFormat kFormat>
__device__ __forceinline__ void StoreCacheChunk(void* cache, int64_t cache_row, int d, int lane,
                                                const float (&x)[kChunk], const float* scale,
                                                bool per_channel, int channel0) {
  static_assert(kChunk == 8, "the quantised layout moves 8 values at a time");
  constexpr int kBits = kFormat == KvFormat::kDense ? 8 * sizeof(T) : KvBits(kFormat);
  char* dst = static_cast<char*>(cache) + (cache_row * d + lane * kChunk) * kBits / 8;
  if constexpr (kFormat == KvFormat::kDense) {
    StoreChunk<T>(dst, x);
  } else {
    using Layout = KvQuantLayout<kFormat>;
    float s[kChunk];
    if (per_channel) {
      LoadChunk<float>(scale + channel0, s);
    } else {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) s[i] = scale[0];
    }
    int q[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) q[i] = Layout::Quantize(x[i], __frcp_rn(ScaleOrOne(s[i])));
    Layout::Store8(dst, q);
  }
}

// One head row (b, s, h) of D elements per group of kLanes lanes, h over N query heads, then Hkv
// key heads, then Hkv value heads (the packed query's order). A group's lanes always take the
// same branches, so its shuffles name just the group.
template <typename T, KvFormat kFormat, int kLanes>
__global__ void __launch_bounds__(kThreads) GqaPrepareKernel(const PrepareParams p) {
  static_assert(kThreads % kLanes == 0 && kLanes <= kMaxLanes, "groups must not straddle warps");
  const int all_heads = p.heads + 2 * p.kv_heads;
  const int64_t row = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / kLanes;
  if (row >= int64_t(p.batch) * p.seq * all_heads) return;  // whole groups
  const int lane = int(threadIdx.x % kLanes);
  const unsigned group = (0xffffffffu >> (32 - kLanes)) << (threadIdx.x % 32 / kLanes * kLanes);
  const int h = int(row % all_heads);
  const int64_t bs = row / all_heads;  // b * S + s
  const int s = int(bs % p.seq);
  const int b = int(bs / p.seq);

  // int32 wrap-around, as the spec's jnp arithmetic: an absurd seqlens_k gives the same refusal.
  const int32_t past = int32_t(uint32_t(p.seqlens[b]) + 1u - uint32_t(p.seq));
  const bool fits = past >= 0 && past <= p.capacity - p.seq;
  if (h == 0 && s == 0 && lane == 0) {
    p.status[b] = fits ? status::kOk : status::kKvWriteOutOfRange;
  }
  const bool is_q = h < p.heads;
  const bool is_k = !is_q && h < p.heads + p.kv_heads;  // else V: stored as given
  if (!is_q && !fits) return;  // a refused batch row writes no K / V (whole groups)
  const int kv_head = is_q ? 0 : is_k ? h - p.heads : h - p.heads - p.kv_heads;

  const int d = p.head_dim;
  const bool active = lane < d / kChunk;  // the rest only take part in the shuffles
  const T* src;
  if (p.packed) {
    src = static_cast<const T*>(p.query) + row * d;
  } else if (is_q) {
    src = static_cast<const T*>(p.query) + (bs * p.heads + h) * d;
  } else {
    src = static_cast<const T*>(is_k ? p.key : p.value) + (bs * p.kv_heads + kv_head) * d;
  }
  float x[kChunk] = {};
  if (active) LoadChunk<T>(src + lane * kChunk, x);

  if ((is_q || is_k) && p.q_norm != nullptr) {
    // reference/norm.py rms_norm: x · rsqrt(mean(x²) + eps) · w in f32, rounded to T.
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kChunk; ++i) ss = fmaf(x[i], x[i], ss);
#pragma unroll
    for (int off = kLanes / 2; off > 0; off /= 2) ss += __shfl_xor_sync(group, ss, off, kLanes);
    const float inv_rms = rsqrtf(ss / float(d) + (is_q ? p.q_eps : p.k_eps));
    if (active) {
      float w[kChunk];
      LoadChunk<T>(static_cast<const T*>(is_q ? p.q_norm : p.k_norm) + lane * kChunk, w);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) x[i] = RoundTo<T>(__fmul_rn(__fmul_rn(x[i], inv_rms), w[i]));
    }
  }

  const int half = p.rotary_half;
  if ((is_q || is_k) && half > 0) {
    // reference/rotary.py on the first R = 2·half features (kernels/common/rotary.cuh).
    int32_t pos = p.position_ids != nullptr ? p.position_ids[bs]
                                            : int32_t(uint32_t(past) + uint32_t(s));
    pos = min(max(pos, 0), p.max_position - 1);  // the spec's gather clips
    const int e0 = lane * kChunk;
    if (p.interleaved) {
      // Pairs (x[2i], x[2i+1]) with angle i: inside one chunk.
      if (active && e0 < 2 * half) {
        const T* cos_row = static_cast<const T*>(p.cos) + int64_t(pos) * half + e0 / 2;
        const T* sin_row = static_cast<const T*>(p.sin) + int64_t(pos) * half + e0 / 2;
#pragma unroll
        for (int i = 0; i < kChunk / 2; ++i) {
          const float c = ToFloat(cos_row[i]), sn = ToFloat(sin_row[i]);
          const float x1 = x[2 * i], x2 = x[2 * i + 1];
          x[2 * i] = RotaryFirst<T>(x1, x2, c, sn);
          x[2 * i + 1] = RotarySecond<T>(x1, x2, c, sn);
        }
      }
    } else {
      // Pairs (x[i], x[i + half]): the partner chunk sits half / kChunk lanes away.
      const int shift = half / kChunk;
      const int partner = lane < shift ? lane + shift : lane < 2 * shift ? lane - shift : lane;
      float y[kChunk];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) y[i] = __shfl_sync(group, x[i], partner, kLanes);
      if (active && e0 < 2 * half) {
        const bool first = e0 < half;  // x1 here, x2 in the partner
        const int64_t angle = int64_t(pos) * half + (first ? e0 : e0 - half);
        float c[kChunk], sn[kChunk];
        LoadChunk<T>(static_cast<const T*>(p.cos) + angle, c);
        LoadChunk<T>(static_cast<const T*>(p.sin) + angle, sn);
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
          x[i] = first ? RotaryFirst<T>(x[i], y[i], c[i], sn[i]) : RotarySecond<T>(y[i], x[i], c[i], sn[i]);
        }
      }
    }
  }

  if (!active) return;
  if (is_q) {
    T* dst = static_cast<T*>(p.q_out) + ((int64_t(b) * p.heads + h) * p.seq + s) * d;
    StoreChunk<T>(dst + lane * kChunk, x);
  } else {
    const int64_t cache_row = (int64_t(b) * p.kv_heads + kv_head) * p.capacity + past + s;
    const int channel0 = kv_head * d + lane * kChunk;
    StoreCacheChunk<T, kFormat>(is_k ? p.k_cache : p.v_cache, cache_row, d, lane, x,
                               is_k ? p.k_scale : p.v_scale,
                               is_k ? p.k_per_channel : p.v_per_channel, channel0);
  }
}

template <typename T, KvFormat kFormat>
void Launch(const PrepareParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.seq * (p.heads + 2 * p.kv_heads);
  // Lanes per row: a power of two covering D / kChunk chunks (8 for D <= 64, 16 for D <= 128).
  const int chunks = p.head_dim / kChunk;
  const int lanes = chunks <= 8 ? 8 : chunks <= 16 ? 16 : 32;
  const unsigned blocks = unsigned((rows * lanes + kThreads - 1) / kThreads);
  switch (lanes) {
    case 8: GqaPrepareKernel<T, kFormat, 8><<<blocks, kThreads, 0, stream>>>(p); break;
    case 16: GqaPrepareKernel<T, kFormat, 16><<<blocks, kThreads, 0, stream>>>(p); break;
    default: GqaPrepareKernel<T, kFormat, 32><<<blocks, kThreads, 0, stream>>>(p); break;
  }
}

}  // namespace
}  // namespace joa::gqa
