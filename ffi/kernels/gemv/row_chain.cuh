// A chain of one-row dense projections in one persistent kernel: phase q computes
// out_q = epilogue(prologue(in_q) W_q^T), its input written by the kernel before or by an earlier
// phase; a grid barrier between phases. Two chains run on it (row_chain.h): the fused gated MLP's
// N split (norm + gate / up + SiLU·up; down + residual) and out_mlp (the attention's output
// projection + residual, then those two).
//
// Why one kernel: a one-row GEMV pays a ramp (no W in flight until its CTAs start), a drain (the
// last tiles' CTAs alone) and a kernel boundary; the small ones (o: 8 MB at ~1B, 5.3 µs a call on
// an H100 against 2.9 at the W-only pace) are mostly that. W does not depend on the phase before,
// so the load cursor runs kDepth steps ahead across each barrier: the next phase's first W is in
// flight while the grid waits. tools/probes/layer_chain.cu measures the chain against the launches.
//
// Geometry (an N split a phase): grid G (at most one CTA an SM, launched
// cooperatively: every CTA resident); CTA c takes the 16-row tiles c, c + G, ... of each phase over
// all of K (warp w its K range), adds its warps' sums in warp order and applies the epilogue itself:
// no partials. At the dense row kernel's 8 warps each phase adds in that kernel's order, so the chain
// gives the separate launches' bits (the RMS norm too: the same threads' squares in the same order).
// Loads and MMAs are dense_row.cuh's.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/convert.cuh"
#include "kernels/gemv/dense_row.cuh"  // DenseRowStep, DenseRowLoad, DenseRowMma, DenseRowTileSums
#include "kernels/gemv/mlp_row.cuh"    // MlpGatedOutput
#include "kernels/gemv/row_chain.h"
#include "kernels/gemv/stage.cuh"

namespace joa::gemv {

// CTA `cta`'s W stream over every phase's tiles, one 2 KB step (16 rows x 64 k) at a time, lane
// (g, t)'s part as dense_row.cuh's; phases where the CTA has no tile are skipped.
template <int kW>
struct RowChainCursor {
  const RowChainParams* p;
  int cta, grid, g, t, wk;
  int phase = -1, j = 0, tile_i = 0, tiles = 0, nsteps = 0;
  int64_t row = 0;
  const uint8_t* wp = nullptr;

  __device__ __forceinline__ void Enter(int q) {
    phase = q;
    j = tile_i = 0;
    if (q >= p->phases) return;
    const RowChainPhase& ph = p->ph[q];
    row = int64_t(ph.k) * 2;
    nsteps = ph.k / (64 * kW);
    tiles = (ph.n_rows / 16 - cta + grid - 1) / grid;
    wp = static_cast<const uint8_t*>(ph.w) + (int64_t(cta) * 16 + (g >> 1)) * row +
         (int64_t(wk) * nsteps * 64 + 32 * (g & 1) + 8 * t) * 2;
  }

  __device__ __forceinline__ void Next(DenseRowStep& st) {
    while (phase < p->phases && tile_i >= tiles) Enter(phase + 1);
    if (phase >= p->phases) return;  // past the last step: nothing to load
    DenseRowLoad(st, wp, row);
    wp += 128;
    if (++j == nsteps) {
      j = 0;
      ++tile_i;
      wp += int64_t(grid) * 16 * row - int64_t(nsteps) * 128;
    }
  }
};

// A phase's input into shared memory, RMS-normed when it has gamma; through L2 (__ldcg): other CTAs
// of this launch wrote it before the grid barrier. Ends with a CTA barrier.
template <typename T, int kW>
__device__ __forceinline__ void RowChainStage(const RowChainPhase& ph, float eps, uint4* s_x, float* s_wsum,
                                              int tid, int lane, int wk) {
  constexpr int kThreadsW = kW * 32;
  const int units = ph.k / 8;
  const uint4* xg = static_cast<const uint4*>(ph.in);
  if (ph.gamma != nullptr) {
    float ss = 0.f;
    for (int u = tid; u < units; u += kThreadsW) {
      const uint4 v = __ldcg(xg + u);
      s_x[u] = v;
      ss = AddSquares8<T>(v, ss);
    }
    const float r = OneRowInverseRms<kW>(ss, s_wsum, lane, wk, ph.k, eps);
    const uint4* gamma = static_cast<const uint4*>(ph.gamma);
    for (int u = tid; u < units; u += kThreadsW) s_x[u] = RmsNormInput::Apply<T>(s_x[u], r, LoadInput16(gamma + u));
  } else {
    for (int u = tid; u < units; u += kThreadsW) s_x[u] = __ldcg(xg + u);
  }
  __syncthreads();
}

template <typename T, int kW, int kDepth>
__global__ void __launch_bounds__(kW * 32, 1) RowChainKernel(const __grid_constant__ RowChainParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* s_x = reinterpret_cast<uint4*>(smem);
  uint4* s_zero = s_x + RowChainMaxK(p) / 8;
  float* s_red = reinterpret_cast<float*>(s_zero + 1);
  float* s_wsum = s_red + 2 * kW * 16;

  const int tid = threadIdx.x, lane = tid & 31, wk = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int cta = int(blockIdx.x), grid = int(gridDim.x);
  auto grid_group = cooperative_groups::this_grid();

  // This CTA's steps over all phases: the consumer's schedule, which the cursor walks too.
  int steps = 0;
  for (int q = 0; q < p.phases; ++q) {
    steps += (p.ph[q].n_rows / 16 - cta + grid - 1) / grid * (p.ph[q].k / (64 * kW));
  }

  RowChainCursor<kW> cur{&p, cta, grid, g, t, wk};
  cur.Enter(0);
  DenseRowStep buf[kDepth];
#pragma unroll
  for (int s = 0; s < kDepth; ++s) cur.Next(buf[s]);
  if (tid == 0) *s_zero = make_uint4(0, 0, 0, 0);

  // The consumer: phase q (its input staged), tile tile_i of it, step j of the tile. Every CTA
  // crosses the phases - 1 barriers, also through phases where it has no tile.
  int staged = -1, q = -1, tile_i = 0, tiles = 0, j = 0, nsteps = 0, it = 0;
  const uint4* xb = s_zero;
  const int xstep = lane < 8 ? 8 : 0;  // B: lanes 0-7 read 8 units of the step's 64 k, the others zero
  float acc[2][2][4] = {};
  auto enter = [&](int next) {
    for (int r = staged + 1; r <= next; ++r) {
      if (r > 0 && r < p.phases) grid_group.sync();
    }
    staged = q = next;
    if (q >= p.phases) return;
    tiles = (p.ph[q].n_rows / 16 - cta + grid - 1) / grid;
    nsteps = p.ph[q].k / (64 * kW);
    tile_i = j = 0;
    RowChainStage<T, kW>(p.ph[q], p.eps, s_x, s_wsum, tid, lane, wk);
    xb = lane < 8 ? s_x + wk * nsteps * 8 + lane : s_zero;
  };
  auto enter_work = [&](int next) {  // the next phase with a tile for this CTA (or the end)
    enter(next);
    while (q < p.phases && tiles == 0) enter(q + 1);
  };
  enter_work(0);

  for (int i0 = 0; i0 < steps; i0 += kDepth) {
#pragma unroll
    for (int s = 0; s < kDepth; ++s) {
      if (i0 + s >= steps) break;
      DenseRowMma<T>(acc, buf[s], xb[j * xstep]);
      cur.Next(buf[s]);
      if (++j < nsteps) continue;
      j = 0;
      // End of a tile: the warps' sums to shared memory, added in warp order by the epilogue.
      float* red = s_red + (it & 1) * kW * 16;
      ++it;
      DenseRowTileSums(acc, g, t, [&](int r, float v) { red[wk * 16 + r] = v; });
      __syncthreads();
      const RowChainPhase& ph = p.ph[q];
      const int tile = cta + tile_i * grid;
      if (ph.gated) {
        if (tid < 8) static_cast<T*>(ph.out)[tile * 8 + tid] = MlpGatedOutput<T, kW>(red, tid);
      } else if (tid < 16) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < kW; ++w) v += red[w * 16 + tid];
        T out = FromFloat<T>(v);
        if (ph.residual != nullptr) {
          out = FromFloat<T>(ToFloat(out) + ToFloat(__ldcg(static_cast<const T*>(ph.residual) + tile * 16 + tid)));
        }
        static_cast<T*>(ph.out)[tile * 16 + tid] = out;
      }
      if (++tile_i == tiles) enter_work(q + 1);
    }
  }
  if (staged < p.phases - 1) enter(p.phases - 1);  // barriers of phases left without a tile here
}

}  // namespace joa::gemv
