// Merges the split partials of DecodeSplitKernel, one warp per packed row: common/split_merge.cuh's
// MergeSplitRow (the math, its determinism and NaN rules), the prefill combine's too.
#pragma once

#include <cstdint>

#include "kernels/common/split_merge.cuh"
#include "kernels/common/variant.cuh"
#include "kernels/convert.cuh"
#include "kernels/decode/params.h"
#include "kernels/decode/plan.h"
#include "kernels/ptx.cuh"

namespace joa::decode {

inline constexpr int kCombineWarps = 4;

template <typename T, int kD>
__global__ void __launch_bounds__(32 * kCombineWarps)
    DecodeCombineKernel(const __grid_constant__ DecodeParams p) {
  __shared__ float s_w[kCombineWarps][kMaxSplits];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row_id = int64_t(blockIdx.x) * kCombineWarps + warp;  // over [B, Hkv, M]
  // Launched as a programmatic dependent of the split kernel: wait until its partials are visible.
  ptx::WaitForPrimary();
  if (row_id >= int64_t(p.batch) * p.kv_heads * p.rows) return;
  const int R = int(row_id % p.rows);
  const int64_t bh = row_id / p.rows;
  const int kvh = int(bh % p.kv_heads), b = int(bh / p.kv_heads);
  const int h = kvh * p.group + R / p.q_len, i = R % p.q_len;
  const int64_t first = bh * p.splits * p.rows + R;  // partial row of split 0; split s at + s * M

  T* out = static_cast<T*>(p.out) + b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_s;
  MergeSplitRow<T, kD, 16>(p.part_o, p.part_lse, first, p.rows, p.splits, SinkLog2(p.variant.sink, h), true,
                           s_w[warp], lane, out);
}

}  // namespace joa::decode
