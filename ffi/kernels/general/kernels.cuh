// General attention kernels: plain CUDA-core code, f32 accumulation, no atomics, every sum in a
// fixed order (bitwise repeatable).
//
// ScoresKernel: one CTA per (KV head x 16 packed rows, 64 keys). Q and K chunks of 64 head-dim
//   elements go through shared memory as f32; each K row is read once for the G heads x S rows of
//   its KV head. Writes x = softcap(scale * q.k) + bias (-inf where hidden) to the f32 score
//   workspace, and qk modes 0-2.
// SoftmaxValuesKernel: one CTA per (KV head x 16 packed rows, 256 value columns). One warp per row
//   takes the softmax max and sum; then V tiles of 32 keys stream through shared memory and
//   y = p @ V accumulates per thread in key order. Writes y and qk mode 3.
//
// Keys at or past kv_len are never read (cache rows there may hold anything, NaN included), except
// by qk modes 0 and 1, which the ONNX spec defines on every key of K: there the K rows are read for
// qk alone, and y still never sees them (hidden keys are -inf by select, their p is 0, their V rows
// are not loaded).
//
// The softmax follows the reference (`core.softmax` on x cast to the softmax dtype): each step (the
// cast, x - max, exp, the division) is rounded to that dtype as XLA rounds it, and the sum is
// accumulated in f32 and rounded once (jnp.sum of a half type). p is cast to Q's dtype before P @ V.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/variant.cuh"
#include "kernels/convert.cuh"
#include "kernels/general/params.h"

namespace joa::general {

// x rounded to the softmax dtype (held in a float).
__device__ __forceinline__ float RoundTo(float x, SoftmaxType t) {
  switch (t) {
    case SoftmaxType::kF16: return __half2float(__float2half_rn(x));
    case SoftmaxType::kBF16: return __bfloat162float(__float2bfloat16_rn(x));
    default: return x;
  }
}

// exp(x - max) in the softmax dtype; max is already rounded to it.
__device__ __forceinline__ float ShiftedExp(float x, float max, SoftmaxType t) {
  return RoundTo(expf(RoundTo(RoundTo(x, t) - max, t)), t);
}

// Butterfly reductions: every lane ends with the same value, combined in the same order each run.
__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ int ValidLength(const GeneralParams& p, int b) {
  return min(max(p.kv_len[b], 0), p.capacity);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) ScoresKernel(const __grid_constant__ GeneralParams p) {
  // +1 column: the 32 lanes of a warp read 32 different K rows at one d without bank conflicts.
  __shared__ float s_q[kRowsPerCta][kChunkD + 1];
  __shared__ float s_k[kScoreKeys][kChunkD + 1];
  const int64_t row_blocks = RowBlocks(p.rows);
  const int bh = int(blockIdx.x / row_blocks);
  const int r0 = int(blockIdx.x % row_blocks) * kRowsPerCta;
  const int b = bh / p.kv_heads, kvh = bh % p.kv_heads;
  const int j0 = int(blockIdx.y) * kScoreKeys;
  const int tid = threadIdx.x;
  const int key = tid % kScoreKeys;                      // this thread's key of the tile
  const int rt = tid / kScoreKeys * kRowsPerThread;      // and its first row of the CTA's 16
  const int len = ValidLength(p, b);
  // qk modes 0 and 1 are defined on every key of K; otherwise only valid rows are read.
  const bool every_key = p.qk_mode == kQkRaw || p.qk_mode == kQkSoftcap;
  const int read_end = every_key ? p.capacity : len;
  const T* q = static_cast<const T*>(p.q) + (int64_t(bh) * p.rows + r0) * p.head_dim;
  const T* k = static_cast<const T*>(p.k) + (int64_t(bh) * p.capacity + j0) * p.head_dim;

  float acc[kRowsPerThread] = {};
  if (j0 < read_end) {  // uniform over the CTA: a tile wholly past the valid rows is only written
    const int rows = min(kRowsPerCta, p.rows - r0);
    const int keys = min(kScoreKeys, read_end - j0);
    for (int d0 = 0; d0 < p.head_dim; d0 += kChunkD) {
      const int dn = min(kChunkD, p.head_dim - d0);
      for (int e = tid; e < kRowsPerCta * kChunkD; e += kThreads) {
        const int r = e / kChunkD, d = e % kChunkD;
        s_q[r][d] = r < rows && d < dn ? ToFloat(q[int64_t(r) * p.head_dim + d0 + d]) : 0.f;
      }
      for (int e = tid; e < kScoreKeys * kChunkD; e += kThreads) {
        const int j = e / kChunkD, d = e % kChunkD;
        s_k[j][d] = j < keys && d < dn ? ToFloat(k[int64_t(j) * p.head_dim + d0 + d]) : 0.f;
      }
      __syncthreads();
#pragma unroll 8
      for (int d = 0; d < kChunkD; ++d) {
        const float kd = s_k[key][d];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) acc[i] = fmaf(s_q[rt + i][d], kd, acc[i]);
      }
      __syncthreads();
    }
  }

  const int j = j0 + key;
  if (j >= p.capacity) return;
  const LogitVariant var(p.variant, len);
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int r = r0 + rt + i;
    if (r >= p.rows) break;
    const int h = kvh * p.group + r / p.q_len, s = r % p.q_len;
    // Positions in 64 bits: a large pos_shift must not wrap.
    const QueryRow<int64_t> row{int64_t(len) - p.q_len + s + p.variant.pos_shift,
                                b * p.variant.bias_stride_b + h * p.variant.bias_stride_h +
                                    s * p.variant.bias_stride_s};
    const float raw = var.Scaled(acc[i]);
    const float capped = var.Capped(raw);
    // Hidden keys by select: garbage in K never reaches x.
    const float x = var.Visible(row, j) ? var.Biased(capped, row, j) : -INFINITY;
    const int64_t at = (int64_t(bh) * p.rows + r) * p.capacity + j;
    p.scores[at] = x;
    if (p.qk_mode >= kQkRaw && p.qk_mode <= kQkBiased) {
      const float out = p.qk_mode == kQkRaw ? raw : p.qk_mode == kQkSoftcap ? capped : x;
      static_cast<T*>(p.qk)[at] = FromFloat<T>(out);
    }
  }
}

template <typename T, typename TV>
__global__ void __launch_bounds__(kThreads) SoftmaxValuesKernel(const __grid_constant__ GeneralParams p) {
  __shared__ float s_v[kValueKeys][kValueCols];
  __shared__ float s_p[kRowsPerCta][kValueKeys + 1];
  __shared__ float s_max[kRowsPerCta], s_sum[kRowsPerCta];
  const int64_t row_blocks = RowBlocks(p.rows);
  const int bh = int(blockIdx.x / row_blocks);
  const int r0 = int(blockIdx.x % row_blocks) * kRowsPerCta;
  const int b = bh / p.kv_heads;
  const int c0 = int(blockIdx.y) * kValueCols;
  const int cols = min(kValueCols, p.v_head_dim - c0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int len = ValidLength(p, b);
  const SoftmaxType sm = p.softmax_type;
  const int64_t c = p.capacity;
  const float* scores = p.scores + (int64_t(bh) * p.rows + r0) * c;

  // Row max and sum over the valid keys (the others are -inf: they change neither).
  for (int i = warp; i < kRowsPerCta; i += kWarps) {
    float m = -INFINITY, sum = 0.f;
    if (r0 + i < p.rows) {
      const float* x = scores + i * c;
      for (int j = lane; j < len; j += 32) m = fmaxf(m, RoundTo(x[j], sm));
      m = WarpMax(m);
      // Every logit -inf (e.g. every key hidden): shift by 0 as core.softmax does; the sum is then
      // 0 and the row's p is 0 (the spec's fully masked row). A +inf max is kept: inf - inf makes
      // the sum NaN, as the spec's math does; so does a NaN logit (fmaxf skips it, the sum does not).
      if (m == -INFINITY) m = 0.f;
      for (int j = lane; j < len; j += 32) sum += ShiftedExp(x[j], m, sm);
      sum = RoundTo(WarpSum(sum), sm);
    }
    if (lane == 0) {
      s_max[i] = m;
      s_sum[i] = sum;
    }
  }
  __syncthreads();

  // Mode 3 is written once, by the first column block.
  const bool write_qk = p.qk_mode == kQkSoftmax && blockIdx.y == 0;
  T* qk = static_cast<T*>(p.qk) + (int64_t(bh) * p.rows + r0) * c;
  const TV* v = static_cast<const TV*>(p.v) + int64_t(bh) * c * p.v_head_dim + c0;
  const int col = tid % kColThreads;                   // columns col + kColThreads * n
  const int rt = tid / kColThreads * kRowsPerThread;   // rows rt .. rt + kRowsPerThread - 1
  float acc[kRowsPerThread][kColsPerThread] = {};
  for (int j0 = 0; j0 < len; j0 += kValueKeys) {
    const int keys = min(kValueKeys, len - j0);
    for (int e = tid; e < kValueKeys * cols; e += kThreads) {
      const int j = e / cols, cc = e % cols;
      s_v[j][cc] = j < keys ? ToFloat(v[int64_t(j0 + j) * p.v_head_dim + cc]) : 0.f;
    }
    for (int e = tid; e < kRowsPerCta * kValueKeys; e += kThreads) {
      const int i = e / kValueKeys, j = e % kValueKeys;
      float pr = 0.f;
      if (r0 + i < p.rows && j < keys) {
        // e / sum; e / 1 = 0 for a fully masked row (sum 0); NaN for a poisoned row (sum NaN).
        const float sum = s_sum[i] == 0.f ? 1.f : s_sum[i];
        pr = RoundTo(ShiftedExp(scores[i * c + j0 + j], s_max[i], sm) / sum, sm);
        const T pt = FromFloat<T>(pr);  // the spec casts p to Q's dtype before P @ V
        if (write_qk) qk[i * c + j0 + j] = pt;
        pr = ToFloat(pt);
      }
      s_p[i][j] = pr;
    }
    __syncthreads();
#pragma unroll 4
    for (int j = 0; j < kValueKeys; ++j) {
      float pj[kRowsPerThread];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) pj[i] = s_p[rt + i][j];
#pragma unroll
      for (int n = 0; n < kColsPerThread; ++n) {
        const float vj = s_v[j][col + kColThreads * n];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) acc[i][n] = fmaf(pj[i], vj, acc[i][n]);
      }
    }
    __syncthreads();
  }

  if (write_qk) {  // keys past the valid length: p = 0, or NaN in a poisoned row (sum NaN)
    for (int i = warp; i < kRowsPerCta && r0 + i < p.rows; i += kWarps) {
      const T pad = FromFloat<T>(isnan(s_sum[i]) ? s_sum[i] : 0.f);
      for (int64_t j = len + lane; j < c; j += 32) qk[i * c + j] = pad;
    }
  }
  T* y = static_cast<T*>(p.y) + (int64_t(bh) * p.rows + r0) * p.v_head_dim + c0;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    if (r0 + rt + i >= p.rows) break;
#pragma unroll
    for (int n = 0; n < kColsPerThread; ++n) {
      const int cc = col + kColThreads * n;
      if (cc < cols) y[int64_t(rt + i) * p.v_head_dim + cc] = FromFloat<T>(acc[i][n]);
    }
  }
}

}  // namespace joa::general
