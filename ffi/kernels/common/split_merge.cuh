// The merge of one packed row's split-KV partials, shared by the decode engine's combine
// (decode/combine.cuh) and the prefill engine's (prefill/combine.cuh): both write normalised f32
// partial rows O_s and their log2-sum-exps lse_s, split s of a row at `first + s * stride` (in rows).
//   M = max(max_s lse_s, sink), w_s = 2^(lse_s - M), y = sum_s w_s O_s / (sum_s w_s + 2^(sink - M)).
// One warp per row; splits are summed in index order and the lane sums through a fixed shuffle
// tree, so the result is bitwise reproducible. Splits that saw no key (lse = -inf) weigh 0 and their
// (unwritten) partials are skipped. A NaN lse (a split poisoned by a NaN or +inf logit) or a NaN sink
// makes M, and so the whole row, NaN: never the 0 of a row that saw no key. A row that is not `live`
// (the prefill rule for rows past q_len) and a row without any key or sink are written as 0.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/convert.cuh"
#include "kernels/ptx.cuh"

namespace joa {

// Up to 32 splits (a lane's lse each) take one L2 round trip instead of three: the lses and the
// first kUnroll splits' partial slices are loaded together (a split that saw no key has an
// unwritten partial: loaded, then replaced by 0, where MergeSplitRow's loop skips the load), the
// weights are shuffled from the lanes that computed them (that loop keeps them in shared memory).
// The same arithmetic in the same order as that loop, so the same bits; the two stay separate
// because they differ in where the weights live and which loads go out before the max.
template <typename T, int kD, int kUnroll>
__device__ __forceinline__ void MergeFewSplitsRow(const float* part_o, const float* part_lse, int64_t first,
                                                  int stride, int splits, float sink_log2, bool live, int lane,
                                                  T* out) {
  static_assert(kUnroll <= 32, "a lane's lse a split");
  const int d0 = lane * 4;  // the lane's first 4 columns; kD > 128 takes further ones after
  const bool lse_lane = live && lane < splits;
  const float lse = lse_lane ? part_lse[first + int64_t(lane) * stride] : -INFINITY;
  float4 x0[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    x0[u] = live && u < splits && d0 < kD
                ? *reinterpret_cast<const float4*>(part_o + (first + int64_t(u) * stride) * kD + d0)
                : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float mx = lse;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = ptx::MaxNan(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  mx = ptx::MaxNan(mx, sink_log2);
  if (!live || mx == -INFINITY) {  // not live, or no visible key in any split and no sink
    for (int d = d0; d < kD; d += 128) StoreVec4(out + d, make_float4(0.f, 0.f, 0.f, 0.f));
    return;
  }
  const float w_lane = lse_lane ? ptx::Exp2(lse - mx) : 0.f;
  float sum = w_lane;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (sink_log2 != -INFINITY) sum += ptx::Exp2(sink_log2 - mx);
  const float inv = sum == 0.f ? 0.f : 1.f / sum;  // NaN stays NaN
  float wv[32];  // split s's weight (0 past splits), from lane s
#pragma unroll
  for (int s = 0; s < 32; ++s) wv[s] = __shfl_sync(0xffffffffu, w_lane, s);
  for (int d = d0; d < kD; d += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int gi = 0; gi < 32 / kUnroll; ++gi) {
      const int s0 = gi * kUnroll;
      if (s0 >= splits) break;
      float w[kUnroll];
      float4 x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int s = s0 + u;
        w[u] = wv[s];
        if (d == d0 && s0 == 0) {
          x[u] = x0[u];
        } else {
          x[u] = s < splits ? *reinterpret_cast<const float4*>(part_o + (first + int64_t(s) * stride) * kD + d)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        if (w[u] == 0.f) x[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        acc.x += w[u] * x[u].x; acc.y += w[u] * x[u].y; acc.z += w[u] * x[u].z; acc.w += w[u] * x[u].w;
      }
    }
    StoreVec4(out + d, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
  }
}

// kUnroll: partials sit in L2 (just written), so kUnroll independent loads go out before any is
// used and a row costs splits / kUnroll L2 round trips (the decode combine takes 16, the prefill 8).
// w_smem: this warp's kMaxSplits floats of shared memory for the weights.
// Up to 32 splits take MergeFewSplitsRow; more, a loop over the lses, then over the partials.
template <typename T, int kD, int kUnroll>
__device__ __forceinline__ void MergeSplitRow(const float* part_o, const float* part_lse, int64_t first,
                                              int stride, int splits, float sink_log2, bool live,
                                              float* w_smem, int lane, T* out) {
  if (splits <= 32) {
    MergeFewSplitsRow<T, kD, kUnroll>(part_o, part_lse, first, stride, splits, sink_log2, live, lane, out);
    return;
  }
  float mx = -INFINITY;
  if (live) {
    for (int s = lane; s < splits; s += 32) mx = ptx::MaxNan(mx, part_lse[first + int64_t(s) * stride]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = ptx::MaxNan(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    mx = ptx::MaxNan(mx, sink_log2);
  }
  if (mx == -INFINITY) {  // not live, or no visible key in any split and no sink
    for (int d = lane * 4; d < kD; d += 128) StoreVec4(out + d, make_float4(0.f, 0.f, 0.f, 0.f));
    return;
  }
  float sum = 0.f;
  for (int s = lane; s < splits; s += 32) {
    const float w = ptx::Exp2(part_lse[first + int64_t(s) * stride] - mx);
    w_smem[s] = w;
    sum += w;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (sink_log2 != -INFINITY) sum += ptx::Exp2(sink_log2 - mx);
  __syncwarp();
  const float inv = sum == 0.f ? 0.f : 1.f / sum;  // NaN stays NaN
  for (int d = lane * 4; d < kD; d += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < splits; s0 += kUnroll) {
      float w[kUnroll];
      float4 x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int s = s0 + u;
        w[u] = s < splits ? w_smem[s] : 0.f;
        x[u] = w[u] != 0.f ? *reinterpret_cast<const float4*>(part_o + (first + int64_t(s) * stride) * kD + d)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        acc.x += w[u] * x[u].x; acc.y += w[u] * x[u].y; acc.z += w[u] * x[u].z; acc.w += w[u] * x[u].w;
      }
    }
    StoreVec4(out + d, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
  }
}

// Launches a combine kernel (one warp per row, `warps` a CTA, over `rows` rows) in the split
// kernel's stream, as a programmatic dependent launch when `pdl` (it may be scheduled while the split
// kernel's last CTAs run and waits in griddepcontrol.wait for their partials). A launch attribute,
// no host sync: capturable into XLA's command buffers.
template <class Params>
inline cudaError_t LaunchCombine(void (*kernel)(Params), const Params& p, int64_t rows, int warps, bool pdl,
                                 cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned((rows + warps - 1) / warps));
  cfg.blockDim = dim3(32 * warps);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

}  // namespace joa
