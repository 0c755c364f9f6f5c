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

#include "kernels/common/split_merge.cuh"
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

  MergeSplitRow<T, kD, 8>(p.part_o, p.part_lse, first, p.rows, p.splits, SinkLog2(p.variant.sink, h), i < q_len,
                          s_w[warp], lane, out);
}

}  // namespace joa::prefill
