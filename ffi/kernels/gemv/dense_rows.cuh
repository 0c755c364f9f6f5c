// The GEMV engine's multi-row path for dense weights: y[M, N] = epilogue(prologue(x)[M, K] W^T) for
// M = 2..32 with W [N, K] row-major as the model stores it, streamed straight into registers as
// the dense row kernel streams it (dense_row.cuh). XLA's half GEMM runs these decode shapes at
// 1.8-4.4 TB/s on the H200 (slowest where N is small: ~8B qkv / o, ~1B down), the ring kernel below
// XLA's; here a warp's loop is the one-row kernel's, a few instructions a KB.
//
// Geometry (plan.h's DenseRowsLayout): a CTA of kWarps warps owns 16-row tiles blockIdx.x,
// + gridDim.x, ...; warp w takes the K range [w K / kWarps, (w + 1) K / kWarps) of each, in steps
// of 64 k (2 KB of the tile). In a step lane (g, t) loads 16 bytes of rows g and g + 8 at
// k = 64 s + 8 t and 64 s + 32 + 8 t. The MMA's k order is free when A and B use the same one:
// m16n8k16 number c reads k = 64 s + 32 c + 8 t + 0..7 of each row as its A fragment (words x, y:
// virtual k 2 t, 2 t + 8; words z, w: a second MMA), and B column n is x row 8 j + n at the same k:
// lane (g, t) reads x row 8 j + g's 16 bytes there from shared memory (x staged as [K / 32][M][32]:
// plan.h's DenseRowsSmemBytes), lanes past M a zero unit. So the C fragment is W rows x x rows,
// with no shuffles. Products are exact in the MMA, sums f32 in a fixed order: a row's result does
// not depend on the other rows of x (any M, any tile), so folded calls keep their bits. The warps'
// partial sums of a tile go through shared memory and are added in warp order by the epilogue's
// threads (epilogue.cuh's policies, the ring kernel's). The RMS-norm prologue: each row's sum of
// squares by one warp in a fixed order, then x <- round(x r gamma) in place.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/gemv/dense_row.cuh"
#include "kernels/gemv/epilogue.cuh"
#include "kernels/gemv/params.h"
#include "kernels/gemv/plan.h"
#include "kernels/gemv/stage.cuh"
#include "kernels/ptx.cuh"

namespace joa::gemv {

// NT n8 tiles of x rows (M <= 8 NT). Needs K % (64 kWarps) == 0 and N % 16 == 0 (DenseRowsLayout).
// Two CTAs an SM below NT 4 (128 registers a thread), one at NT 4 (its 32 accumulators).
// kFull (an experiment, session 25): the dense row kernel's loads (8 lanes a 128-byte line: rows
// g/2 + {0, 8, 4, 12} at k = 64 s + 32 (g & 1) + 8 t), MMA row g holding k-slice g & 1 of its W
// row, so B column c is (x row 4 nt + c / 2, slice c & 1): NT = ceil(M / 4) tiles, twice the MMAs,
// and a row's sum C[g][2 t + (g & 1)] + the same of lane g ^ 1.
template <typename T, int NT, class Prologue, class Epilogue, int kDepth, bool kFull = false>
__global__ void __launch_bounds__(kThreads, (kFull ? NT > 4 : NT == 4) ? 1 : 2) GemvDenseRowsKernel(const __grid_constant__ GemvParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int M = p.m, K = p.k;
  uint4* s_x = reinterpret_cast<uint4*>(smem);
  uint4* s_zero = reinterpret_cast<uint4*>(smem + DenseRowsZeroOffset(M, K));
  float* s_red = reinterpret_cast<float*>(smem + DenseRowsRedOffset(M, K));
  float* s_inv = reinterpret_cast<float*>(smem + DenseRowsInvOffset(M, K));

  const int tid = threadIdx.x, lane = tid & 31, wk = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int units = K / 8;  // 16-byte units of an x row
  const int nsteps = K / (64 * kWarps);
  const int tiles = (p.blocks - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x);
  const int steps = tiles * nsteps;
  const int64_t row_bytes = int64_t(K) * 2;
  const int64_t lane_off = kFull ? int64_t(g >> 1) * row_bytes + (int64_t(wk) * nsteps * 64 + 32 * (g & 1) + 8 * t) * 2
                                 : int64_t(g) * row_bytes + (int64_t(wk) * nsteps * 64 + 8 * t) * 2;

  ptx::LaunchDependents();

  // The load cursor runs kDepth steps ahead of the math, across tile boundaries. w: row g at
  // k 8 t, row g + 8 there, row g at 32 + 8 t, row g + 8 there.
  int ld_step = 0, ld_j = 0, ld_it = 0;
  const uint8_t* wp = nullptr;
  auto load_next = [&](DenseRowStep& st) {
    if (ld_step < steps) {
      if (ld_j == 0) {
        const int tile = int(blockIdx.x) + ld_it * int(gridDim.x);
        wp = static_cast<const uint8_t*>(p.w) + int64_t(tile) * 16 * row_bytes + lane_off;
      }
      if constexpr (kFull) {
        st.w[0] = LoadStream16(wp);
        st.w[1] = LoadStream16(wp + 8 * row_bytes);
        st.w[2] = LoadStream16(wp + 4 * row_bytes);
        st.w[3] = LoadStream16(wp + 12 * row_bytes);
      } else {
        st.w[0] = LoadStream16(wp);
        st.w[1] = LoadStream16(wp + 8 * row_bytes);
        st.w[2] = LoadStream16(wp + 64);
        st.w[3] = LoadStream16(wp + 8 * row_bytes + 64);
      }
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
  // Unit j of row m (x[m][8 j .. 8 j + 7]) goes to (j / 4, m, j % 4) of [K / 32][M][4 units].
  auto x_at = [&](int m, int j) { return ((j >> 2) * M + m) * 4 + (j & 3); };
  const uint4* xg = static_cast<const uint4*>(p.x);
  for (int u = tid; u < M * units; u += kThreads) {
    const int m = u / units, j = u - m * units;
    s_x[x_at(m, j)] = LoadInput16(xg + u);
  }
  if constexpr (Prologue::kNorm) {
    __syncthreads();
    // Row m's sum of squares by warp m % kWarps: lane l over units l, l + 32, ... in order, then a
    // butterfly; lane 0's value (the order does not depend on M).
    for (int m = wk; m < M; m += kWarps) {
      float ss = 0.f;
      for (int j = lane; j < units; j += 32) ss = AddSquares8<T>(s_x[x_at(m, j)], ss);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      if (lane == 0) s_inv[m] = rsqrtf(__fdiv_rn(ss, float(K)) + p.eps);
    }
    __syncthreads();
    const uint4* gamma = static_cast<const uint4*>(p.gamma);
    for (int u = tid; u < M * units; u += kThreads) {
      const int m = u / units, j = u - m * units;
      uint4& v = s_x[x_at(m, j)];
      v = Prologue::template Apply<T>(v, s_inv[m], LoadInput16(gamma + j));
    }
  }
  if (tid == 0) *s_zero = make_uint4(0, 0, 0, 0);
  __syncthreads();

  // B: lane (g, t) of n8 tile nt reads x row 8 nt + g's unit t of each 32-k piece of the warp's
  // K range (two pieces a step), or the zero unit past M.
  const uint4* xb[NT];
  int xstep[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int m = kFull ? 4 * nt + (g >> 1) : 8 * nt + g;
    const int piece0 = wk * nsteps * 2 + (kFull ? (g & 1) : 0);
    xb[nt] = m < M ? s_x + (piece0 * M + m) * 4 + t : s_zero;
    xstep[nt] = m < M ? 4 * M : 0;  // units from one 32-k piece to the next
  }

  float acc[NT][2][4] = {};  // [n8 tile][chain: words x, y / z, w][C fragment]
  int j = 0, it = 0;
  for (int i0 = 0; i0 < steps; i0 += kDepth) {
#pragma unroll
    for (int s = 0; s < kDepth; ++s) {
      if (i0 + s >= steps) break;
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // kFull: c is the row group rg (rows g/2 + 4 rg, + 8)
        const uint4& lo = buf[s].w[2 * c];
        const uint4& hi = buf[s].w[2 * c + 1];
        const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};
        const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint4 xv = xb[nt][(kFull ? 2 * j : 2 * j + c) * xstep[nt]];
          ptx::Mma16816Free<T>(acc[nt][kFull ? c : 0], a0, xv.x, xv.y);
          ptx::Mma16816Free<T>(acc[nt][kFull ? c : 1], a1, xv.z, xv.w);
        }
      }
      load_next(buf[s]);  // step i + kDepth into the registers just consumed
      if (++j < nsteps) continue;
      j = 0;
      // End of a tile: C element e of lane (g, t) is W row g + 8 (e >> 1) against x row
      // 8 nt + 2 t + (e & 1); the warps' sums go to red[w][m][row], the epilogue adds them in
      // warp order.
      float* red = s_red + (it & 1) * kWarps * M * kDenseRowsRedStride;
      const int tile = int(blockIdx.x) + it * int(gridDim.x);
      ++it;
      if constexpr (kFull) {
        // Lane (g, t): C[g][2 t + (g & 1)] is W row g/2 + 4 rg (+ 8 h) over k-slice g & 1 against x
        // row 4 nt + t; lane g ^ 1 (lane ^ 4) holds the other slice.
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int m = 4 * nt + t;
#pragma unroll
          for (int rg = 0; rg < 2; ++rg) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float v = (g & 1) ? acc[nt][rg][2 * h + 1] : acc[nt][rg][2 * h];
              v += __shfl_xor_sync(0xffffffffu, v, 4);
              if ((g & 1) == 0 && m < M) red[(wk * M + m) * kDenseRowsRedStride + (g >> 1) + 4 * rg + 8 * h] = v;
              acc[nt][rg][2 * h] = acc[nt][rg][2 * h + 1] = 0.f;
            }
          }
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int m = 8 * nt + 2 * t + (e & 1);
            if (m < M) red[(wk * M + m) * kDenseRowsRedStride + g + 8 * (e >> 1)] = acc[nt][0][e] + acc[nt][1][e];
            acc[nt][0][e] = acc[nt][1][e] = 0.f;
          }
        }
      }
      __syncthreads();
      constexpr int kUnits = Epilogue::OutCols(16) / 8;  // 8-output units of a tile's row
      if (tid < M * kUnits) {
        const int m = tid / kUnits, oc = 8 * (tid % kUnits);
        Epilogue::template Apply<T>(p, m, tile, oc, [&](int r0, float (&v8)[8]) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) v += red[(w * M + m) * kDenseRowsRedStride + r0 + e];
            v8[e] = v;
          }
        });
      }
    }
  }
}

}  // namespace joa::gemv
