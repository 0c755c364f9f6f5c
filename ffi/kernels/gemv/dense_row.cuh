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

// Shared memory: x (K of T, after the prologue), a zero unit, [2][kWarps][16] f32 partial row sums
// (alternating tiles), kWarps f32 norm partial sums.
__host__ __device__ inline int DenseRowZeroOffset(int k) { return k * 2; }
__host__ __device__ inline int DenseRowRedOffset(int k) { return k * 2 + 16; }
__host__ __device__ inline int DenseRowSmemBytes(int k) {
  return DenseRowRedOffset(k) + 2 * kWarps * 16 * 4 + kWarps * 4;
}

struct DenseRowStep {
  uint4 w[4];  // rows g/2 + 0, + 8, + 4, + 12
};

// Lane (g, t)'s 16 bytes of a step: wp at its row g/2 and k offset, rows row_bytes apart.
__device__ __forceinline__ void DenseRowLoad(DenseRowStep& st, const uint8_t* wp, int64_t row_bytes) {
  st.w[0] = LoadStream16(wp);
  st.w[1] = LoadStream16(wp + 8 * row_bytes);
  st.w[2] = LoadStream16(wp + 4 * row_bytes);
  st.w[3] = LoadStream16(wp + 12 * row_bytes);
}

// A step's two MMAs per row group: A the loaded words as they are, B x's two 32-k halves (xv).
template <typename T>
__device__ __forceinline__ void DenseRowMma(float (&acc)[2][2][4], const DenseRowStep& st, uint4 xv) {
#pragma unroll
  for (int rg = 0; rg < 2; ++rg) {
    const uint4& lo = st.w[2 * rg];
    const uint4& hi = st.w[2 * rg + 1];
    const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};
    const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};
    ptx::Mma16816Free<T>(acc[rg][0], a0, xv.x, xv.y);
    ptx::Mma16816Free<T>(acc[rg][1], a1, xv.z, xv.w);
  }
}

// The end of a tile: lane (g, 0) takes column g & 1 of its C rows and adds lane g ^ 1's (one
// shuffle); on the even g, put(r, v) gets the warp's sum of tile row r. Zeroes the accumulators.
template <class Put>
__device__ __forceinline__ void DenseRowTileSums(float (&acc)[2][2][4], int g, int t, Put&& put) {
#pragma unroll
  for (int rg = 0; rg < 2; ++rg) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float c0 = acc[rg][0][2 * h] + acc[rg][1][2 * h];
      const float c1 = acc[rg][0][2 * h + 1] + acc[rg][1][2 * h + 1];
      float v = (g & 1) ? c1 : c0;
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      if (t == 0 && (g & 1) == 0) put((g >> 1) + 4 * rg + 8 * h, v);
#pragma unroll
      for (int e = 0; e < 2; ++e) acc[rg][e][2 * h] = acc[rg][e][2 * h + 1] = 0.f;
    }
  }
}

// Needs K % (64 kWarps) == 0 and N % 16 == 0 (plan.h's DenseRowLayout).
template <typename T, class Prologue, class Epilogue, int kDepth>
__global__ void __launch_bounds__(kThreads, 2) GemvDenseRowKernel(const __grid_constant__ GemvParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* s_x = reinterpret_cast<uint4*>(smem);
  uint4* s_zero = reinterpret_cast<uint4*>(smem + DenseRowZeroOffset(p.k));
  float* s_red = reinterpret_cast<float*>(smem + DenseRowRedOffset(p.k));
  float* s_wsum = s_red + 2 * kWarps * 16;

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
      DenseRowLoad(st, wp, row_bytes);
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
    float ss = 0.f;  // each thread's units, then the slots kernel's fixed-order statistics
    for (int u = tid; u < units; u += kThreads) {
      const uint4 v = LoadInput16(xg + u);
      s_x[u] = v;
      ss = AddSquares8<T>(v, ss);
    }
    const float r = OneRowInverseRms(ss, s_wsum, lane, wk, p.k, p.eps);
    const uint4* gamma = static_cast<const uint4*>(p.gamma);
    for (int u = tid; u < units; u += kThreads) s_x[u] = Prologue::template Apply<T>(s_x[u], r, LoadInput16(gamma + u));
  } else {
    for (int u = tid; u < units; u += kThreads) s_x[u] = LoadInput16(xg + u);
  }
  if (tid == 0) *s_zero = make_uint4(0, 0, 0, 0);
  __syncthreads();
  // The epilogue's once-a-CTA reads, in flight while the first tile streams (warp 0's own W steps
  // are already under way).
  using Ahead = OneRowAhead<T, Epilogue>;
  const Ahead ahead = tid < Epilogue::OutCols(16) / 8 ? Ahead::Read(p, int(blockIdx.x)) : Ahead{};

  // B: lanes 0-7 read x units 8 s + lane of the warp's K range; the others the zero unit.
  const uint4* xb = lane < 8 ? s_x + wk * nsteps * 8 + lane : s_zero;
  const int xstep = lane < 8 ? 8 : 0;

  float acc[2][2][4] = {};  // [rows g/2 + 4 rg (+ 8)][chain: words x, y / z, w][C fragment]
  int j = 0, it = 0;
  for (int i0 = 0; i0 < steps; i0 += kDepth) {
#pragma unroll
    for (int s = 0; s < kDepth; ++s) {
      if (i0 + s >= steps) break;
      DenseRowMma<T>(acc, buf[s], xb[j * xstep]);
      load_next(buf[s]);  // step i + kDepth into the registers just consumed
      if (++j < nsteps) continue;
      j = 0;
      // End of a tile: the even g write the warp's partial sums, the epilogue's threads add the
      // warps in order.
      float* red = s_red + (it & 1) * kWarps * 16;
      const int tile = int(blockIdx.x) + it * int(gridDim.x);
      ++it;
      DenseRowTileSums(acc, g, t, [&](int r, float v) { red[wk * 16 + r] = v; });
      __syncthreads();
      OneRowTileEpilogue<T, Epilogue>(p, tile, red, 16, tid, ahead);
    }
  }
}

}  // namespace joa::gemv
