// The gated MLP of one decode row in one kernel: y = round(round(h W_down^T) + residual) with
// h = round(silu(round(n W_gate^T)) * round(n W_up^T)) and n = the RMS-normed x (optional), the
// roundings of the two-GEMV path (dense_row.cuh with GatedSiluEpilogue, then StoreEpilogue).
//
// Why one kernel: the two GEMVs each pay a ramp (no W in flight until the CTAs start) and a drain
// (the last tiles' CTAs alone) on ~67 + 34 MB at ~1B; here every CTA streams its gate-up tiles and
// then, with no barrier between, its slice of W_down: the down loads are issued while the gate-up
// math finishes, because CTA c's down work needs only the h values CTA c computed itself.
//
// Geometry: grid G (one CTA an SM at most, launched cooperatively: every CTA resident); CTA c owns
// the gate-up tiles [c T, (c + 1) T) (16 interleaved rows, 8 outputs of h each; T = I / 8 / G), so
// h[8 c T, 8 (c + 1) T) lands in its shared memory. Its down work is the K slice of W_down at those
// columns: every 16-row tile of W_down (warp w takes tiles w, w + kW, ...), giving an f32 partial
// sum of all H outputs. The partials [G, H] go to the workspace; after a grid barrier CTA c adds
// the partials of its rows in CTA order (deterministic) and applies the epilogue.
//
// The N split (JOA_GATED_MLP_SPLIT=n) is the two-phase row chain (row_chain.cuh): h to the
// workspace, one grid barrier, whole rows of y a CTA; the two GEMVs' bits.
//
// Loads and MMAs are dense_row.cuh's: a step is 16 rows x 64 k (2 KB), lane (g, t) holds 16 bytes of
// rows g/2, g/2 + 8, g/2 + 4, g/2 + 12 as the A operands of two m16n8k16 MMAs, B carries two 32-k
// halves of x (or h) in its two columns.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/convert.cuh"
#include "kernels/gemv/dense_row.cuh"  // DenseRowStep
#include "kernels/gemv/stage.cuh"
#include "kernels/gemv/mlp_row.h"
#include "kernels/ptx.cuh"

namespace joa::gemv {

// The W stream: the gate-up tiles [cta T, (cta + 1) T) a warp's K range at a time, then the down
// tiles, `down_advance` bytes from one down tile's first step to the next one's.
struct MlpLoadCursor {
  const uint8_t* wp;
  int64_t stride, row_a, row_b, down_advance;
  const uint8_t* w_dn;
  int ld, ld_j, steps, steps_a, nsteps_a, nsteps_b;

  __device__ __forceinline__ void Next(DenseRowStep& st) {
    if (ld < steps) {
      DenseRowLoad(st, wp, stride);
      wp += 128;
    }
    ++ld;
    if (ld <= steps_a) {
      if (++ld_j == nsteps_a) {  // next gate-up tile (or the first down tile)
        ld_j = 0;
        wp += 16 * row_a - nsteps_a * 128;
      }
      if (ld == steps_a) {
        wp = w_dn;
        stride = row_b;
      }
    } else if (++ld_j == nsteps_b) {  // this warp's / CTA's next down tile
      ld_j = 0;
      wp += down_advance - nsteps_b * 128;
    }
  }
};

// x (H of T) into shared memory, RMS-normed when kNorm, and the zero unit; ends with a barrier.
template <typename T, int kW, bool kNorm>
__device__ __forceinline__ void MlpStageInput(const MlpRowParams& p, uint4* s_x, uint4* s_zero, float* s_wsum,
                                              int tid, int lane, int wk) {
  constexpr int kThreadsW = kW * 32;
  const int units = p.h / 8;
  const uint4* xg = static_cast<const uint4*>(p.x);
  if constexpr (kNorm) {
    float ss = 0.f;
    for (int u = tid; u < units; u += kThreadsW) {
      const uint4 v = LoadInput16(xg + u);
      s_x[u] = v;
      ss = AddSquares8<T>(v, ss);
    }
    const float r = OneRowInverseRms<kW>(ss, s_wsum, lane, wk, p.h, p.eps);
    const uint4* gamma = static_cast<const uint4*>(p.gamma);
    for (int u = tid; u < units; u += kThreadsW) s_x[u] = RmsNormInput::Apply<T>(s_x[u], r, LoadInput16(gamma + u));
  } else {
    for (int u = tid; u < units; u += kThreadsW) s_x[u] = LoadInput16(xg + u);
  }
  if (tid == 0) *s_zero = make_uint4(0, 0, 0, 0);
  __syncthreads();
}

// Output `o` (< 8) of a gate-up tile from the warps' sums (gate row o, up row o + 8; warps in order):
// round(silu(g) * u) of the rounded products, as GatedSiluEpilogue.
template <typename T, int kW>
__device__ __forceinline__ T MlpGatedOutput(const float* red, int o) {
  float vg = 0.f, vu = 0.f;
#pragma unroll
  for (int w = 0; w < kW; ++w) {
    vg += red[w * 16 + o];
    vu += red[w * 16 + 8 + o];
  }
  const float gr = ToFloat(FromFloat<T>(vg));
  const float ur = ToFloat(FromFloat<T>(vu));
  return FromFloat<T>(__fmul_rn(__fdiv_rn(gr, 1.f + expf(-gr)), ur));
}

// The K split's end, after the grid barrier: CTA c adds the f32 partials [G, H] of its rows of y in
// CTA order (deterministic; a row's CTAs in runs over several threads, the runs then in order),
// rounds, adds the residual (rounded again) and stores. s_fin: kW * 32 floats.
template <typename T, int kW>
__device__ __forceinline__ void MlpAddPartials(const float* partials, int h, const void* residual, void* y,
                                               float* s_fin, int tid) {
  constexpr int kThreadsW = kW * 32;
  const int grid = int(gridDim.x), cta = int(blockIdx.x);
  const int rows_per = (h + grid - 1) / grid;
  const int r0 = cta * rows_per, nr = min(rows_per, h - r0);
  if (nr <= 0) return;
  const int parts = max(1, min(kThreadsW / nr, grid));  // threads a row, each a run of CTAs
  const int per = (grid + parts - 1) / parts;
  if (tid < nr * parts) {
    const int r = tid % nr, q = tid / nr;
    float v = 0.f;
    const int c1 = min(grid, (q + 1) * per);
    for (int c = q * per; c < c1; ++c) v += __ldcg(partials + int64_t(c) * h + r0 + r);
    s_fin[q * nr + r] = v;
  }
  __syncthreads();
  for (int r = tid; r < nr; r += kThreadsW) {
    float v = 0.f;
    for (int q = 0; q < parts; ++q) v += s_fin[q * nr + r];
    T out = FromFloat<T>(v);
    if (residual != nullptr) out = FromFloat<T>(ToFloat(out) + ToFloat(static_cast<const T*>(residual)[r0 + r]));
    static_cast<T*>(y)[r0 + r] = out;
  }
}

template <typename T, int kW, int kDepth, bool kNorm>
__global__ void __launch_bounds__(kW * 32, 1) MlpRowKernel(const __grid_constant__ MlpRowParams p) {
  constexpr int kThreadsW = kW * 32;
  using Smem = MlpRowSmem<kW>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tiles = p.tiles_per_cta, hc = 8 * tiles;
  uint4* s_x = reinterpret_cast<uint4*>(smem);
  T* s_h = reinterpret_cast<T*>(smem + Smem::HOffset(p.h));
  uint4* s_zero = reinterpret_cast<uint4*>(smem + Smem::ZeroOffset(p.h, tiles));
  float* s_red = reinterpret_cast<float*>(smem + Smem::RedOffset(p.h, tiles));
  float* s_wsum = s_red + 2 * kW * 16;
  float* s_fin = s_wsum + kW;

  const int tid = threadIdx.x, lane = tid & 31, wk = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int cta = int(blockIdx.x);
  const int nsteps_a = p.h / (64 * kW);  // a gate-up tile's steps a warp (its K range)
  const int steps_a = tiles * nsteps_a;
  const int nsteps_b = hc / 64;          // a down tile's steps (the whole slice, one warp)
  const int tiles_b = p.h / 16 / kW;
  const int steps = steps_a + tiles_b * nsteps_b;
  const int64_t row_a = int64_t(p.h) * 2, row_b = int64_t(p.inter) * 2;
  const int64_t lane_a = int64_t(g >> 1) * row_a + (int64_t(wk) * nsteps_a * 64 + 32 * (g & 1) + 8 * t) * 2;
  const int64_t lane_b = int64_t(g >> 1) * row_b + (int64_t(cta) * hc + 32 * (g & 1) + 8 * t) * 2;
  const uint8_t* w_gu = static_cast<const uint8_t*>(p.w_gu) + int64_t(cta) * tiles * 16 * row_a + lane_a;
  const uint8_t* w_dn = static_cast<const uint8_t*>(p.w_down) + int64_t(wk) * 16 * row_b + lane_b;

  // The load cursor runs kDepth steps ahead of the math, across tiles and across the phases.
  MlpLoadCursor cur{w_gu, row_a, row_a, row_b, kW * 16 * row_b, w_dn, 0, 0, steps, steps_a, nsteps_a, nsteps_b};
  DenseRowStep buf[kDepth];
#pragma unroll
  for (int s = 0; s < kDepth; ++s) cur.Next(buf[s]);

  MlpStageInput<T, kW, kNorm>(p, s_x, s_zero, s_wsum, tid, lane, wk);

  // B: lanes 0-7 read 8 units of the step's 64 k, the others the zero unit.
  const uint4* xb = lane < 8 ? s_x + wk * nsteps_a * 8 + lane : s_zero;
  const uint4* hb = lane < 8 ? reinterpret_cast<const uint4*>(s_h) + lane : s_zero;
  const int xstep = lane < 8 ? 8 : 0;
  float* part = p.partials + int64_t(cta) * p.h;

  float acc[2][2][4] = {};
  int j = 0, it = 0;
  for (int i0 = 0; i0 < steps; i0 += kDepth) {
#pragma unroll
    for (int s = 0; s < kDepth; ++s) {
      const int i = i0 + s;
      if (i >= steps) break;
      const bool gate_up = i < steps_a;
      if (i == steps_a) __syncthreads();  // h complete (every warp has the same steps_a)
      DenseRowMma<T>(acc, buf[s], gate_up ? xb[j * xstep] : hb[j * xstep]);
      cur.Next(buf[s]);
      if (++j < (gate_up ? nsteps_a : nsteps_b)) continue;
      j = 0;
      // End of a tile: a gate-up tile's warp sums to shared memory, a down tile's straight to
      // this CTA's partials (one warp holds the whole K slice).
      float* red = s_red + (it & 1) * kW * 16;
      const int down_row0 = (wk + it * kW) * 16;
      DenseRowTileSums(acc, g, t, [&](int r, float v) {
        if (gate_up) {
          red[wk * 16 + r] = v;
        } else {
          part[down_row0 + r] = v;
        }
      });
      if (gate_up) {
        __syncthreads();
        if (tid < 8) s_h[it * 8 + tid] = MlpGatedOutput<T, kW>(red, tid);  // output tid of the tile
        if (++it == tiles) it = 0;  // the down tiles count from 0
      } else {
        ++it;
      }
    }
  }

  // Every CTA's partials written: CTA c adds those of its rows in CTA order.
  cooperative_groups::this_grid().sync();
  MlpAddPartials<T, kW>(p.partials, p.h, p.residual, p.y, s_fin, tid);
}

}  // namespace joa::gemv
