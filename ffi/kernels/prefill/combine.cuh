// Merges the split-KV partials of the prefill engine (engine.cuh SplitEpilogue) into y: for each
// packed row of a live query row,
//   M = max(max_s lse_s, sink), w_s = 2^(lse_s - M), y = sum_s w_s O_s / (sum_s w_s + 2^(sink - M)),
// the decode engine's combine (decode/combine.cuh) on its workspace layout, plus the prefill rule
// that rows past q_len[b] are 0 whatever the sink (as the unsplit epilogue writes them). One warp per
// row; splits are summed in index order and the lanes' weights through a fixed shuffle tree, so the
// result is bitwise reproducible. Splits that saw no key (lse = -inf) weigh 0 and their (unwritten)
// partials are skipped; a row no split saw a key of and without a sink is 0. A NaN lse or a NaN
// sink makes M, and so the row, NaN (as the unsplit epilogue).
#pragma once

#include <cstdint>

#include "kernels/common/variant.cuh"
#include "kernels/convert.cuh"
#include "kernels/prefill/params.h"
#include "kernels/prefill/plan.h"
#include "kernels/ptx.cuh"

namespace joa::prefill {

inline constexpr int kCombineWarps = 4;

template <typename T, int kD>
__global__ void __launch_bounds__(32 * kCombineWarps)
    PrefillCombineKernel(const __grid_constant__ PrefillParams p) {
  __shared__ float s_w[kCombineWarps][kMaxSplits];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row_id = int64_t(blockIdx.x) * kCombineWarps + warp;  // over [B, Hkv, M]
  // Launched as a programmatic dependent of the split kernel: wait until its partials are visible.
  ptx::WaitForPrimary();
  if (row_id >= int64_t(p.batch) * p.kv_heads * p.rows) return;
  const int R = int(row_id % p.rows);
  const int64_t bh = row_id / p.rows;
  const int kvh = int(bh % p.kv_heads), b = int(bh / p.kv_heads);
  const int h = kvh * p.group + R / p.q_rows, i = R % p.q_rows;
  const int q_len = min(max(p.q_len[b], 0), p.q_rows);
  const int64_t first = bh * p.splits * p.rows + R;  // partial row of split 0; split s at + s * M
  // Packed row R of (b, kvh) is row i of query head h: y [B, Hq, S, D] row bh * M + R.
  T* out = static_cast<T*>(p.y) + (bh * p.rows + R) * kD;

  float mx = -INFINITY, sink = -INFINITY;
  if (i < q_len) {
    for (int s = lane; s < p.splits; s += 32) mx = ptx::MaxNan(mx, p.part_lse[first + int64_t(s) * p.rows]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = ptx::MaxNan(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    sink = SinkLog2(p.variant.sink, h);
    mx = ptx::MaxNan(mx, sink);
  }
  if (mx == -INFINITY) {  // a row past q_len, or no visible key in any split and no sink
    for (int d = lane * 4; d < kD; d += 128) StoreVec4(out + d, make_float4(0.f, 0.f, 0.f, 0.f));
    return;
  }
  float sum = 0.f;
  for (int s = lane; s < p.splits; s += 32) {
    const float w = ptx::Exp2(p.part_lse[first + int64_t(s) * p.rows] - mx);
    s_w[warp][s] = w;
    sum += w;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (sink != -INFINITY) sum += ptx::Exp2(sink - mx);
  __syncwarp();
  const float inv = sum == 0.f ? 0.f : 1.f / sum;  // NaN stays NaN
  // Partials sit in L2 (just written): kUnroll independent loads before using any, so a row costs
  // splits / kUnroll L2 round trips. Accumulation stays in split order.
  constexpr int kUnroll = 8;
  for (int d = lane * 4; d < kD; d += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < p.splits; s0 += kUnroll) {
      float w[kUnroll];
      float4 x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int s = s0 + u;
        w[u] = s < p.splits ? s_w[warp][s] : 0.f;
        x[u] = w[u] != 0.f ? *reinterpret_cast<const float4*>(p.part_o + (first + int64_t(s) * p.rows) * kD + d)
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

}  // namespace joa::prefill
