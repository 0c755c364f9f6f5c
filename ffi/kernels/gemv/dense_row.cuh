// The GEMV engine's one-row path for dense weights: y[1, N] = epilogue(prologue(x)[1, K] W^T) with W
// [N, K] row-major as the model stores it, streamed straight into registers at a few instructions a
// KB (the ring kernel spends ~70: its cp.async ring, waits and address math made it 0.80-0.93x of
// XLA's GEMV; this one streams at 0.9-0.99x of a kernel that only reads W on the ~1B / ~8B
// projection shapes: tools/probes/gemv_dense_m1.cu, bench/results/2026-12-02-gemv-dense-row.json).
//
// Geometry: a CTA of kWarps warps owns 16-row tiles blockIdx.x, + gridDim.x, ...; warp w takes the
// K range [w K / kWarps, (w + 1) K / kWarps) of each, in steps of 64 k (2 KB of the tile). In a
// step lane (g, t) loads 16 bytes of rows g/2, g/2 + 8, g/2 + 4, g/2 + 12 at k = 64 s + 32 (g & 1)
// + 8 t: the 8 lanes of a row read 128 contiguous bytes (whole L2 lines, half the requests of 4
// lanes a row). The words are the A registers of two m16n8k16 MMAs as loaded: MMA row g holds
// k-slice g & 1 of its W row, B column 0 carries x's slice 0 and column 1 slice 1 (lanes 0-7 read
// 128 contiguous bytes of x from shared memory, the other lanes a zero unit), so the row's sum is
// C[g][g & 1] + C[g ^ 1][g & 1 ^ 1]: lanes t = 0 of g and g ^ 1, one shuffle. Products are exact
// in the MMA and sums f32, in a fixed order (deterministic). The epilogue policies are the ring
// kernel's (epilogue.cuh), on the tile's 16 row sums added over the warps in warp order.
//
// Rows (kRows 4 or 8: M <= kRows rows of x, decode at batch 2-8): B's 8 columns carry 4 rows of x,
// row r's k-slices 0 and 1 in columns 2r and 2r + 1 (lane (g, t) reads row g / 2's slice g & 1), so
// the same W registers meet 4 rows in the same two MMAs, and a second pair of MMAs takes rows 4-7.
// Lane (g, t)'s C fragment holds columns 2t, 2t + 1: row t's sums, reduced as the one row's (lanes
// t = 0) are. Each row is the one-row kernel's arithmetic in the same order (the same bits a row).
// Shared memory grows with M (x and the partial sums a row), so large K takes fewer rows (plan.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/gemv/epilogue.cuh"
#include "kernels/gemv/params.h"
#include "kernels/gemv/plan.h"
#include "kernels/gemv/stage.cuh"
#include "kernels/ptx.cuh"

namespace joa::gemv {

// Steps (2 KB of W a warp) in flight per warp: 3 (probe, H200: 2 was up to 20% slower on the
// shapes with few steps a warp, 4 no faster).
inline constexpr int kDenseRowDepth = 3;

// Shared memory for m rows of x: x (m x K of T, after the prologue), a zero unit, [2][m][kWarps][16]
// f32 partial row sums (alternating tiles), [m][kWarps] f32 norm partial sums.
__host__ __device__ inline int DenseRowZeroOffset(int k, int m = 1) { return m * k * 2; }
__host__ __device__ inline int DenseRowRedOffset(int k, int m = 1) { return m * k * 2 + 16; }
__host__ __device__ inline int DenseRowSmemBytes(int k, int m = 1) {
  return DenseRowRedOffset(k, m) + m * (2 * kWarps * 16 * 4 + kWarps * 4);
}

// The rows kernel's end of a 16-row tile for M rows (after a CTA barrier): red[r * kWarps * 16 +
// w * 16 + i] holds warp w's partial sum of W row i for x row r; the 16 threads of x row r (half a
// warp) add the warps in order, then its epilogue threads store row r's outputs (OneRowTileEpilogue
// a row: the same order, the same bits).
template <typename T, class Epilogue>
__device__ __forceinline__ void RowsTileEpilogue(const GemvParams& p, int tile, float* red, int m_rows, int tid) {
  const int r = tid >> 4, i = tid & 15;
  if (r >= m_rows) return;
  float* rr = red + r * kWarps * 16;
  float v = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) v += rr[w * 16 + i];
  rr[i] = v;
  __syncwarp(0xFFFFu << (16 * (r & 1)));
  if (i < Epilogue::OutCols(16) / 8) {
    Epilogue::template Apply<T>(p, r, tile, i * 8, [&](int r0, float (&v8)[8]) {
#pragma unroll
      for (int e = 0; e < 8; ++e) v8[e] = rr[r0 + e];
    });
  }
}

struct DenseRowStep {
  uint4 w[4];  // rows g/2 + 0, + 8, + 4, + 12
};

// Needs K % (64 kWarps) == 0 and N % 16 == 0 (plan.h's DenseRowLayout), p.m <= kRows.
template <typename T, class Prologue, class Epilogue, int kDepth, int kRows = 1>
__global__ void __launch_bounds__(kThreads, 2) GemvDenseRowKernel(const __grid_constant__ GemvParams p) {
  static_assert(kRows == 1 || kRows == 4 || kRows == 8, "the dense row kernel takes 1, 4 or 8 rows");
  constexpr int kGroups = kRows == 8 ? 2 : 1;  // sets of 4 x rows: a pair of MMAs each
  const int m_rows = kRows == 1 ? 1 : p.m;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* s_x = reinterpret_cast<uint4*>(smem);
  uint4* s_zero = reinterpret_cast<uint4*>(smem + DenseRowZeroOffset(p.k, m_rows));
  float* s_red = reinterpret_cast<float*>(smem + DenseRowRedOffset(p.k, m_rows));
  float* s_wsum = s_red + 2 * kWarps * 16 * m_rows;

  const int tid = threadIdx.x, lane = tid & 31, wk = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int units = p.k / 8;
  const int nsteps = p.k / (64 * kWarps);
  const int tiles = (p.blocks - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x);
  const int steps = tiles * nsteps;
  const int64_t row_bytes = int64_t(p.k) * 2;
  const int64_t lane_off = int64_t(g >> 1) * row_bytes + (int64_t(wk) * nsteps * 64 + 32 * (g & 1) + 8 * t) * 2;

  ptx::LaunchDependents();

  // The load cursor runs kDepth steps ahead of the math, across tile boundaries.
  int ld_step = 0, ld_j = 0, ld_it = 0;
  const uint8_t* wp = nullptr;
  auto load_next = [&](DenseRowStep& st) {
    if (ld_step < steps) {
      if (ld_j == 0) {
        const int tile = int(blockIdx.x) + ld_it * int(gridDim.x);
        wp = static_cast<const uint8_t*>(p.w) + int64_t(tile) * 16 * row_bytes + lane_off;
      }
      st.w[0] = LoadStream16(wp);
      st.w[1] = LoadStream16(wp + 8 * row_bytes);
      st.w[2] = LoadStream16(wp + 4 * row_bytes);
      st.w[3] = LoadStream16(wp + 12 * row_bytes);
      wp += 128;
    }
    ++ld_step;
    if (++ld_j == nsteps) {
      ld_j = 0;
      ++ld_it;
    }
  };
  DenseRowStep buf[kDepth];
#pragma unroll
  for (int s = 0; s < kDepth; ++s) load_next(buf[s]);

  // x (and gamma) may come from the previous kernel: W above is a parameter nothing writes.
  ptx::WaitForPrimary();
  const uint4* xg = static_cast<const uint4*>(p.x);
  if constexpr (Prologue::kNorm) {
    // Each row's statistics as the slots kernel's (thread, warp, then the warps in order; a row's
    // bits do not depend on the others), all rows under one barrier.
    float ss[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      ss[r] = 0.f;
      if (r >= m_rows) break;
      for (int u = tid; u < units; u += kThreads) {
        const uint4 v = LoadInput16(xg + r * units + u);
        s_x[r * units + u] = v;
        ss[r] = AddSquares8<T>(v, ss[r]);
      }
      StoreWarpSquares(ss[r], s_wsum + r * kWarps, lane, wk);
    }
    __syncthreads();
    const uint4* gamma = static_cast<const uint4*>(p.gamma);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= m_rows) break;
      const float inv = InverseRmsOfWarpSquares(s_wsum + r * kWarps, p.k, p.eps);
      for (int u = tid; u < units; u += kThreads) {
        s_x[r * units + u] = Prologue::template Apply<T>(s_x[r * units + u], inv, LoadInput16(gamma + u));
      }
    }
  } else {
    for (int u = tid; u < m_rows * units; u += kThreads) s_x[u] = LoadInput16(xg + u);
  }
  if (tid == 0) *s_zero = make_uint4(0, 0, 0, 0);
  __syncthreads();
  // The epilogue's once-a-CTA reads, in flight while the first tile streams (warp 0's own W steps
  // are already under way).
  using Ahead = OneRowAhead<T, Epilogue>;
  const Ahead ahead = kRows == 1 && tid < Epilogue::OutCols(16) / 8 ? Ahead::Read(p, int(blockIdx.x)) : Ahead{};

  // B: lane (g, t) of set q reads row 4 q + g / 2's x units 8 s + 4 (g & 1) + t of the warp's K
  // range, the zero unit past M (one row: lanes 0-7 read units 8 s + lane).
  const uint4* xb[kGroups];
  int xstep[kGroups];
#pragma unroll
  for (int q = 0; q < kGroups; ++q) {
    const int r = 4 * q + (g >> 1);
    const bool mine = r < m_rows;
    xb[q] = mine ? s_x + r * units + wk * nsteps * 8 + 4 * (g & 1) + t : s_zero;
    xstep[q] = mine ? 8 : 0;
  }

  // [set of 4 x rows][W rows g/2 + 4 rg (+ 8)][chain: words x, y / z, w][C fragment]
  float acc[kGroups][2][2][4] = {};
  int j = 0, it = 0;
  for (int i0 = 0; i0 < steps; i0 += kDepth) {
#pragma unroll
    for (int s = 0; s < kDepth; ++s) {
      if (i0 + s >= steps) break;
#pragma unroll
      for (int q = 0; q < kGroups; ++q) {
        const uint4 xv = xb[q][j * xstep[q]];
#pragma unroll
        for (int rg = 0; rg < 2; ++rg) {
          const uint4& lo = buf[s].w[2 * rg];
          const uint4& hi = buf[s].w[2 * rg + 1];
          const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};
          const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};
          ptx::Mma16816Free<T>(acc[q][rg][0], a0, xv.x, xv.y);
          ptx::Mma16816Free<T>(acc[q][rg][1], a1, xv.z, xv.w);
        }
      }
      load_next(buf[s]);  // step i + kDepth into the registers just consumed
      if (++j < nsteps) continue;
      j = 0;
      // End of a tile: lane (g, t) takes column 2t + (g & 1) of its C rows (x row 4q + t) and adds
      // lane g ^ 1's; the even g write the warp's partial sums (one row: lanes t = 0), the epilogue's
      // threads add the warps in order.
      float* red = s_red + (it & 1) * kWarps * 16 * m_rows;
      const int tile = int(blockIdx.x) + it * int(gridDim.x);
      ++it;
#pragma unroll
      for (int q = 0; q < kGroups; ++q) {
        const int r = 4 * q + t;
        const bool writes = (g & 1) == 0 && r < m_rows;
#pragma unroll
        for (int rg = 0; rg < 2; ++rg) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float c0 = acc[q][rg][0][2 * h] + acc[q][rg][1][2 * h];
            const float c1 = acc[q][rg][0][2 * h + 1] + acc[q][rg][1][2 * h + 1];
            float v = (g & 1) ? c1 : c0;
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            if (writes) red[r * kWarps * 16 + wk * 16 + (g >> 1) + 4 * rg + 8 * h] = v;
#pragma unroll
            for (int e = 0; e < 2; ++e) acc[q][rg][e][2 * h] = acc[q][rg][e][2 * h + 1] = 0.f;
          }
        }
      }
      __syncthreads();
      if constexpr (kRows == 1) {
        OneRowTileEpilogue<T, Epilogue>(p, tile, red, 16, tid, ahead);
      } else {
        RowsTileEpilogue<T, Epilogue>(p, tile, red, m_rows, tid);
      }
    }
  }
}

}  // namespace joa::gemv
