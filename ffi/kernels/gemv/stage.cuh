// x into shared memory, once per CTA, in the order the MMA B fragments read it; the prologue
// policies (plain, or RMS-normalised on the way in).
//
// Layout: 16-byte units u = ((cl * quads + q) * M + m) * 4 + t hold x[m][k .. k + 7] with
// k = (slice0 + cl) * chunk_k + lane_stride * t + QuadK(q) (plan.h's FormatInfo): lane (g, t) of n8 tile j reads unit
// (cl, q, m = 8 j + g, t) for the B fragment of quad q of its chunk. Eight lanes of a 128-bit
// shared load read 128 contiguous bytes: no bank conflicts. 4-bit weights stage each unit permuted
// to (x0, x4, x1, x5, x2, x6, x3, x7), the pair order their dequantisation produces (weights.cuh).
// Units past K are zeros; chunks past the last are not staged (never read).
//
// Every unit (and gamma's slice) is requested with cp.async at once, so staging costs one L2 round
// trip, overlapping the weight stream's first chunks; the statistics of the norm come from the
// staged slice (summed over the cluster in rank order), and the norm and the permutation are then
// applied in place. Two halves: StageXIssue (the copies, one commit group) and StageXFinish (wait
// for that group, then the norm and the permutation). A kernel that is not a programmatic
// dependent issues x's group before the weight ring's, so that the finishing pass runs while the
// first chunks of W are still in flight (it waits for x's group only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/convert.cuh"
#include "kernels/gemv/cluster.cuh"
#include "kernels/gemv/params.h"
#include "kernels/gemv/plan.h"
#include "kernels/gemv/weights.cuh"

namespace joa::gemv {

// 16 bytes of an input other than W (x, gamma, bias, residual): small and re-read, through L1.
__device__ __forceinline__ uint4 LoadInput16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// Asks for the line holding p in L1 without waiting for it or holding a register: a later
// LoadInput16 of it hits L1 (the fused QKV epilogue's cos / sin, prefetched before the tile streams).
__device__ __forceinline__ void PrefetchL1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p));
}

// 16 bytes of W, read once (the one-row kernels, which load W straight into registers): not kept
// in L1.
__device__ __forceinline__ uint4 LoadStream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
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

// s + the squares of 8 T values, in order, in f32 (the norm's statistics).
template <typename T>
__device__ __forceinline__ float AddSquares8(uint4 v, float s) {
  const Vec8<T> x = AsVec8<T>(v);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float e = ToFloat(x.v[i]);
    s = __fmaf_rn(e, e, s);
  }
  return s;
}

// The one-row kernels' inverse RMS of x from each thread's sum of squares `ss`: the warp's sum by
// a butterfly, the warps' sums added in warp order (s_wsum: kW floats), so every thread gets
// the same value. A CTA barrier inside: every thread of the CTA (kW warps) calls it.
template <int kW = kWarps>
__device__ __forceinline__ float OneRowInverseRms(float ss, float* s_wsum, int lane, int warp, int k, float eps) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (lane == 0) s_wsum[warp] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kW; ++w) total += s_wsum[w];
  return rsqrtf(__fdiv_rn(total, float(k)) + eps);
}

// x as it is.
struct PlainInput {
  static constexpr bool kNorm = false;
};

// x <- round_T(x * rsqrt(mean(x^2) + eps) * gamma), statistics in f32 (onnxruntime's
// SimplifiedLayerNormalization / jax_onnx_attn.ops.reference.norm.rms_norm).
struct RmsNormInput {
  static constexpr bool kNorm = true;

  template <typename T>
  __device__ __forceinline__ static uint4 Apply(uint4 v, float r, uint4 gamma) {
    const Vec8<T> x = AsVec8<T>(v), g = AsVec8<T>(gamma);
    Vec8<T> out;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out.v[i] = FromFloat<T>(__fmul_rn(__fmul_rn(ToFloat(x.v[i]), r), ToFloat(g.v[i])));
    }
    return AsUint4(out);
  }
};

// (x0..x7) -> (x0, x4, x1, x5, x2, x6, x3, x7).
__device__ __forceinline__ uint4 PermuteForNibbles(uint4 v) {
  return make_uint4(Prmt(v.x, v.z, 0x5410u), Prmt(v.x, v.z, 0x7632u), Prmt(v.y, v.w, 0x5410u),
                    Prmt(v.y, v.w, 0x7632u));
}

// K index of unit u's first element of this CTA's x slice, and its x row m (the layout above).
template <class Weights>
__device__ __forceinline__ int UnitK(const GemvParams& p, int slice0, int u, int& m) {
  constexpr FormatInfo kF = Weights::kInfo;
  int rest = u >> 2;
  if (p.m == 1) {  // decode at batch 1: no division (by a runtime M it is ~25 dependent instructions)
    m = 0;
  } else {
    m = rest % p.m;
    rest /= p.m;
  }
  return (slice0 + rest / kF.quads) * kF.chunk_k + kF.lane_stride * (u & 3) + QuadK(kF, rest % kF.quads);
}

// 16-byte units of this CTA's x slice (chunks [slice0, slice0 + slice_chunks), the last ones past
// K not staged).
template <class Weights>
__device__ __forceinline__ int SliceUnits(const GemvParams& p, int slice0) {
  const int chunks = min(p.slice_chunks, p.kc - slice0);
  return max(chunks, 0) * Weights::kInfo.quads * p.m * 4;
}

// Starts copying this CTA's chunks [slice0, slice0 + slice_chunks) of x (and of gamma with the
// norm): one commit group.
// Probes (tools/probes/gemv_slots.cu) may define JOA_GEMV_X_COPY(ptr, elements) to give each CTA
// its own copy of x and gamma (the cost of every CTA reading the same vector from L2).
#ifndef JOA_GEMV_X_COPY
#define JOA_GEMV_X_COPY(ptr, elements) (ptr)
#endif
#ifndef JOA_GEMV_X_ROTATE
#define JOA_GEMV_X_ROTATE 1
#endif

// The unit a thread's i-th step visits (i = tid, tid + kThreads, ...), in StageXIssue's copies and
// StageXFinish's pass alike (a thread may only read back its own copies before a barrier): each CTA
// starts at its own place, 37 lines apart, as CTAs walking x in one order ask the same L2 lines at
// the same time (M = 8-16: up to 1-3 us a call on the 1B / 8B LM heads). rot = XRotation(units).
__device__ __forceinline__ int XRotation(int units) {
  return JOA_GEMV_X_ROTATE ? int((blockIdx.x * 296u) % unsigned(max(units, 1))) : 0;
}
__device__ __forceinline__ int XUnit(int i, int rot, int units) {
  return i + rot < units ? i + rot : i + rot - units;
}

template <typename T, class Weights, class Prologue>
__device__ __forceinline__ void StageXIssue(const GemvParams& p, unsigned char* smem, int slice0, int tid) {
  constexpr FormatInfo kF = Weights::kInfo;
  const T* x = static_cast<const T*>(JOA_GEMV_X_COPY(p.x, int64_t(p.m) * p.k));
  const T* gamma = static_cast<const T*>(JOA_GEMV_X_COPY(p.gamma, p.k));
  unsigned char* s_x = smem;
  unsigned char* s_gamma = smem + p.gamma_offset;  // gamma[slice0 * chunk_k ...]
  const int chunks = min(p.slice_chunks, p.kc - slice0);
  const int units = SliceUnits<Weights>(p, slice0);
  const int rot = XRotation(units);
  for (int i = tid; i < units; i += kThreads) {
    const int u = XUnit(i, rot, units);
    int m;
    const int kk = UnitK<Weights>(p, slice0, u, m);
    const bool valid = kk < p.k;
    CpAsync16(SmemAddr(s_x + int64_t(u) * 16),
              x + (valid ? int64_t(m) * p.k + kk : 0), valid);
  }
  if constexpr (Prologue::kNorm) {
    const int k0 = slice0 * kF.chunk_k;
    for (int v = tid; v < max(chunks, 0) * kF.chunk_k / 8; v += kThreads) {
      const bool valid = k0 + 8 * v < p.k;
      CpAsync16(SmemAddr(s_gamma + v * 16), gamma + (valid ? k0 + 8 * v : 0), valid);
    }
  }
  CpAsyncCommit();
}

// Waits until x's group has landed (`newer`: copy groups the thread committed after it, which may
// stay in flight), then applies the norm and the int4 permutation in place. Ends with the CTA's
// units complete but not yet visible to other threads: the caller synchronises.
template <typename T, class Weights, class Prologue>
__device__ __forceinline__ void StageXFinish(const GemvParams& p, unsigned char* smem, int slice0, int tid,
                                             int newer) {
  constexpr FormatInfo kF = Weights::kInfo;
  unsigned char* s_x = smem;
  float* s_part = reinterpret_cast<float*>(smem + p.x_bytes + p.red_bytes);  // [kMaxM] sums
  float* s_norm = s_part + kMaxM;                                             // [kMaxM] 1 / rms
  unsigned char* s_gamma = smem + p.gamma_offset;  // gamma[slice0 * chunk_k ...]
  const int chunks = min(p.slice_chunks, p.kc - slice0);
  const int units = SliceUnits<Weights>(p, slice0);
  CpAsyncWaitPending(newer);
  if constexpr (Prologue::kNorm) {
    __syncthreads();  // every unit landed, for the statistics
    // This CTA's sum of squares of each x row over its slice, in a fixed order: with M < kWarps
    // rows, each row's units are split over kWarps / M warps ("parts"; with one row a single warp
    // summing it was a ~2 us serial chain), their sums left in the reduction buffers (unused until
    // the first row block) and added in part order.
    const int warp = tid >> 5, lane = tid & 31;
    float* s_wpart = reinterpret_cast<float*>(smem + p.x_bytes);  // [parts][M]
    const int parts = max(1, kWarps / p.m);
    const int row_units = max(chunks, 0) * kF.quads * 4;
    const int span = (row_units + parts - 1) / parts;
    for (int job = warp; job < p.m * parts; job += kWarps) {
      const int m = job % p.m, part = job / p.m;
      float s = 0.f;
      for (int f = part * span + lane; f < min(row_units, (part + 1) * span); f += 32) {
        s = AddSquares8<T>(*reinterpret_cast<const uint4*>(s_x + int64_t(((f >> 2) * p.m + m) * 4 + (f & 3)) * 16), s);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (lane == 0) s_wpart[part * p.m + m] = s;
    }
    __syncthreads();
    if (tid < p.m) {
      float s = 0.f;
      for (int part = 0; part < parts; ++part) s += s_wpart[part * p.m + tid];
      s_part[tid] = s;
    }
    // The whole row's sum: the cluster's slices in rank order (so every CTA gets the same bits).
    ClusterSync(p.cluster);
    if (tid < p.m) {
      float s = 0.f;
      for (int r = 0; r < p.cluster; ++r) s += RemoteShared(s_part, r)[tid];
      s_norm[tid] = rsqrtf(__fdiv_rn(s, float(p.k)) + p.eps);
    }
    __syncthreads();
  }
  if constexpr (Prologue::kNorm || Weights::kPermuteX) {
    const int rot = XRotation(units);  // the units this thread copied (XUnit)
    for (int i = tid; i < units; i += kThreads) {
      const int u = XUnit(i, rot, units);
      int m;
      const int kk = UnitK<Weights>(p, slice0, u, m);
      if (kk >= p.k) continue;  // zeros stay zeros
      uint4* unit = reinterpret_cast<uint4*>(s_x + int64_t(u) * 16);
      uint4 v = *unit;
      if constexpr (Prologue::kNorm) {
        v = Prologue::template Apply<T>(v, s_norm[m],
                                        *reinterpret_cast<const uint4*>(s_gamma + (kk - slice0 * kF.chunk_k) * 2));
      }
      if constexpr (Weights::kPermuteX) v = PermuteForNibbles(v);
      *unit = v;
    }
  }
}

}  // namespace joa::gemv
