// x into shared memory, once per CTA, in the order the MMA B fragments read it; the prologue
// policies (plain, or RMS-normalised on the way in).
//
// Layout: 16-byte units u = ((cl * quads + q) * M + m) * 4 + t hold x[m][k .. k + 7] with
// k = (slice0 + cl) * chunk_k + lane_k * t + 8 q: lane (g, t) of n8 tile j reads unit
// (cl, q, m = 8 j + g, t) for the B fragment of quad q of its chunk. Eight lanes of a 128-bit
// shared load read 128 contiguous bytes: no bank conflicts. 4-bit weights stage each unit permuted
// to (x0, x4, x1, x5, x2, x6, x3, x7), the pair order their dequantisation produces (weights.cuh).
// Units past K are zeros; chunks past the last are not staged (never read).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/convert.cuh"
#include "kernels/gemv/params.h"
#include "kernels/gemv/plan.h"
#include "kernels/gemv/weights.cuh"

namespace joa::gemv {

// 16 bytes of an input other than W (x, gamma, bias, residual): small and re-read, through L1.
__device__ __forceinline__ uint4 LoadInput16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

template <typename T>
struct alignas(16) Vec8 {
  T v[8];
};

template <typename T>
__device__ __forceinline__ Vec8<T> AsVec8(uint4 u) {
  return *reinterpret_cast<Vec8<T>*>(&u);
}

template <typename T>
__device__ __forceinline__ uint4 AsUint4(const Vec8<T>& v) {
  return *reinterpret_cast<const uint4*>(&v);
}

// x as it is.
struct PlainInput {
  static constexpr bool kNorm = false;
  template <typename T>
  __device__ __forceinline__ static void Stats(const GemvParams&, float*, int, int) {}
  template <typename T>
  __device__ __forceinline__ static uint4 Apply(const GemvParams&, const float*, uint4 v, int, int) {
    return v;
  }
};

// x <- round_T(x * rsqrt(mean(x^2) + eps) * gamma), statistics in f32 (onnxruntime's
// SimplifiedLayerNormalization / jax_onnx_attn.ops.reference.norm.rms_norm). Every CTA computes the
// statistics of all M rows over all of K with the same code, so they agree to the bit.
struct RmsNormInput {
  static constexpr bool kNorm = true;

  // s_norm[m] = rsqrt(mean_k x[m, k]^2 + eps); one warp per row, a fixed summation order.
  template <typename T>
  __device__ __forceinline__ static void Stats(const GemvParams& p, float* s_norm, int warp, int lane) {
    for (int m = warp; m < p.m; m += kWarps) {
      const T* row = static_cast<const T*>(p.x) + int64_t(m) * p.k;
      float s = 0.f;
      for (int kk = 8 * lane; kk < p.k; kk += 8 * 32) {
        const Vec8<T> v = AsVec8<T>(LoadInput16(row + kk));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float f = ToFloat(v.v[i]);
          s = __fmaf_rn(f, f, s);
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (lane == 0) s_norm[m] = rsqrtf(__fdiv_rn(s, float(p.k)) + p.eps);
    }
  }

  template <typename T>
  __device__ __forceinline__ static uint4 Apply(const GemvParams& p, const float* s_norm, uint4 v,
                                                int m, int kk) {
    const float r = s_norm[m];
    const Vec8<T> x = AsVec8<T>(v);
    const Vec8<T> gamma = AsVec8<T>(LoadInput16(static_cast<const T*>(p.gamma) + kk));
    Vec8<T> out;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out.v[i] = FromFloat<T>(__fmul_rn(__fmul_rn(ToFloat(x.v[i]), r), ToFloat(gamma.v[i])));
    }
    return AsUint4(out);
  }
};

// (x0..x7) -> (x0, x4, x1, x5, x2, x6, x3, x7).
__device__ __forceinline__ uint4 PermuteForNibbles(uint4 v) {
  return make_uint4(Prmt(v.x, v.z, 0x5410u), Prmt(v.x, v.z, 0x7632u), Prmt(v.y, v.w, 0x5410u),
                    Prmt(v.y, v.w, 0x7632u));
}

// Stages this CTA's chunks [slice0, slice0 + slice_chunks) of x (s_norm ready when normalising).
template <typename T, class Weights, class Prologue>
__device__ __forceinline__ void StageX(const GemvParams& p, unsigned char* s_x, const float* s_norm,
                                       int slice0, int tid) {
  constexpr FormatInfo kF = Weights::kInfo;
  const int chunks = min(p.slice_chunks, p.kc - slice0);
  const int units = chunks * kF.quads * p.m * 4;
  for (int u = tid; u < units; u += kThreads) {
    const int t = u & 3;
    int rest = u >> 2;
    const int m = rest % p.m;
    rest /= p.m;
    const int q = rest % kF.quads;
    const int cl = rest / kF.quads;
    const int kk = (slice0 + cl) * kF.chunk_k + kF.lane_k * t + 8 * q;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (kk < p.k) {
      v = LoadInput16(static_cast<const T*>(p.x) + int64_t(m) * p.k + kk);
      v = Prologue::template Apply<T>(p, s_norm, v, m, kk);
      if constexpr (Weights::kPermuteX) v = PermuteForNibbles(v);
    }
    *reinterpret_cast<uint4*>(s_x + int64_t(u) * 16) = v;
  }
}

}  // namespace joa::gemv
