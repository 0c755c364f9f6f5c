// The gated MLP of one decode row on 4-bit weights in one kernel: y = round(round(h W_down^T) +
// residual), h = round(silu(round(n W_gate^T)) * round(n W_up^T)), n = the RMS-normed x (optional),
// with the roundings of the two-GEMV path (the slots kernel on the record layout with
// GatedSiluEpilogue, then with the residual).
//
// Why: at one row the 4-bit down projection pays most for being a kernel of its own. A 16-row tile
// of 4-bit W is a quarter of a dense tile's bytes, so with one tile a CTA (~8B: 256 tiles) staging
// x (14336 elements) costs a quarter of the W the CTA streams, and the ramp and drain are as long
// as the dense kernel's on a quarter of the bytes (~8B int4 down 13.4 us for 35 MB, ~1B 6.4 us for
// 9 MB, H200). Here, as in the dense K split (mlp_row.cuh), CTA c computes a slice of h and then
// streams the K slice of W_down that reads only that slice: the down projection's x is in the CTA's
// shared memory already, and its W is in flight while the gate-up math ends.
//
// Geometry: grid G (one CTA an SM at most, launched cooperatively). CTA c owns the gate-up tiles
// [c T, (c + 1) T) (16 interleaved rows: 8 outputs of h each), i.e. T x H / 256 records of the
// record layout, contiguous; warp w takes records [w q, (w + 1) q) of them (q = ceil(T H / 256 /
// kW)), so a tile's sums may come from several warps (slots [tile][warp] of shared memory, added
// in warp order). Each record is the slots kernel's chunk (slots.cuh: raw magic-number halves as A,
// eight quantisation pieces in the eight MMA columns, scale and zero point applied per piece in
// f32). After a barrier h's slice (8 T) lands in shared memory, staged as the slots kernel stages
// x. The down work is the K slice [8 c T, 8 (c + 1) T) of every 16-row tile of W_down (warp w: tiles w, w + kW,
// ...), read from slice records (mlp_nbits.h): per record and lane 16 bytes, rows g and g + 8 at
// 16 k, the four lanes t the four MMA columns t (one 16-k piece each, inside one quantisation
// block), so per record 4 MMAs and the scale / zero point per (row, piece) in f32 again. A warp
// holds a down tile's whole slice: its 16 f32 sums go to this CTA's partials [G, H]; after a grid
// barrier CTA c adds the partials of its rows in CTA order (mlp_row.cuh's MlpAddPartials).
// Deterministic (fixed orders everywhere); the sums are not the two GEMVs' order (within the
// dtype's tolerance of them).
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/convert.cuh"
#include "kernels/gemv/mlp_nbits.h"
#include "kernels/gemv/mlp_row.cuh"  // MlpGatedOutput, MlpAddPartials
#include "kernels/gemv/slots.cuh"    // RecordFormat, SlotsStageUnit, SlotUnitK, ScaleToFloat
#include "kernels/gemv/stage.cuh"
#include "kernels/ptx.cuh"

namespace joa::gemv {

// One step of a lane's W stream, either phase: a gate-up record (w as RecordChunk's words j = 2 h +
// piece; m[0] its two scale words, m[1].x its zero-point word) or four slice records (w[e], m[e]:
// record e's 16 bytes and its 8 metadata bytes for the lane's half).
struct MlpNbitsStep {
  uint4 w[4];
  uint2 m[4];
};

// Starts copying x (H of T) into shared memory in the slots kernel's fragment order: one commit
// group, issued before the first W steps (x requested after W waited behind it in the slots kernel,
// slots.cuh). A thread reads back only the units it copied (MlpNbitsStageX).
template <int kW>
__device__ __forceinline__ void MlpNbitsIssueX(const MlpNbitsParams& p, unsigned char* s_x, int tid) {
  const unsigned char* x = static_cast<const unsigned char*>(p.x);
  for (int u = tid; u < p.h / 8; u += kW * 32) CpAsync16(SmemAddr(s_x + u * 16), x + SlotUnitK(u) * 2, true);
  CpAsyncCommit();
}

// Waits for x (MlpNbitsIssueX), RMS-norms it when kNorm and stages it (SlotsStageUnit), with Off_p /
// X_p per 32-k piece; the zero area; ends with a barrier.
template <typename T, int kW, bool kNorm>
__device__ __forceinline__ void MlpNbitsStageX(const MlpNbitsParams& p, unsigned char* s_x, unsigned char* s_zero,
                                               float2* s_piece, float* s_wsum, int tid, int lane, int wk) {
  using F = SlotFormat<T>;
  constexpr int kThreadsW = kW * 32;
  const int units = p.h / 8;  // whole chunks (32 units), so whole warps a pass
  uint4* sx = reinterpret_cast<uint4*>(s_x);
  CpAsyncWaitPending(0);
  float r = 0.f;
  if constexpr (kNorm) {
    float ss = 0.f;
    for (int u = tid; u < units; u += kThreadsW) ss = AddSquares8<T>(sx[u], ss);
    r = OneRowInverseRms<kW>(ss, s_wsum, lane, wk, p.h, p.eps);
  }
  const T* gamma = static_cast<const T*>(p.gamma);
  for (int u = tid; u < units; u += kThreadsW) {
    uint4 v = sx[u];
    if constexpr (kNorm) v = RmsNormInput::Apply<T>(v, r, LoadInput16(gamma + SlotUnitK(u)));
    float staged = 0.f, full = 0.f;
    sx[u] = SlotsStageUnit<T>(v, staged, full);
    // A piece's four units are the lanes that differ in bits 2-3: a butterfly over those.
#pragma unroll
    for (int m = 4; m <= 8; m <<= 1) {
      staged += __shfl_xor_sync(0xffffffffu, staged, m);
      full += __shfl_xor_sync(0xffffffffu, full, m);
    }
    if ((lane & 12) == 0) s_piece[SlotUnitK(u) >> 5] = make_float2(F::kOffset * (F::kHalf ? staged : full), full);
  }
  for (int i = tid; i < 512 / 16; i += kThreadsW) reinterpret_cast<uint4*>(s_zero)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
}

// The CTA's slice of h from the gate-up row sums: after a barrier (every warp's slots written),
// one thread an output (tile u's output o: the warps' slots in order, rounded as
// GatedSiluEpilogue) into s_h as T values, unit u = tile u; after another, thread p stages units
// 2 p and 2 p + 1 in place (SlotsStageUnit) with their Off_p / X_p (one 16-k piece). Ends with a
// barrier.
template <typename T, int kW>
__device__ __forceinline__ void MlpNbitsStageH(const float* s_red, uint4* s_h, float2* s_hpiece, int tiles, int tid) {
  using F = SlotFormat<T>;
  constexpr int kThreadsW = kW * 32;
  __syncthreads();
  T* raw = reinterpret_cast<T*>(s_h);
  for (int i = tid; i < tiles * 8; i += kThreadsW) raw[i] = MlpGatedOutput<T, kW>(s_red + (i >> 3) * kW * 16, i & 7);
  __syncthreads();
  for (int pc = tid; pc < tiles / 2; pc += kThreadsW) {
    float staged = 0.f, full = 0.f;
#pragma unroll
    for (int i = 0; i < 2; ++i) s_h[2 * pc + i] = SlotsStageUnit<T>(s_h[2 * pc + i], staged, full);
    s_hpiece[pc] = make_float2(F::kOffset * (F::kHalf ? staged : full), full);
  }
  __syncthreads();
}

template <typename T, int kW, int kDepth, bool kNorm>
__global__ void __launch_bounds__(kW * 32, 1) MlpNbitsKernel(const __grid_constant__ MlpNbitsParams p) {
  using F = RecordFormat<T>;
  constexpr int kThreadsW = kW * 32;
  using Smem = MlpNbitsSmem<kW>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tiles = p.tiles_per_cta;
  unsigned char* s_x = smem;
  unsigned char* s_zero = smem + Smem::ZeroOffset(p.h);
  float2* s_xpiece = reinterpret_cast<float2*>(smem + Smem::XPieceOffset(p.h));
  float* s_red = reinterpret_cast<float*>(smem + Smem::RedOffset(p.h));  // [tiles][kW][16]
  uint4* s_h = reinterpret_cast<uint4*>(smem + Smem::HOffset(p.h, tiles));
  float2* s_hpiece = reinterpret_cast<float2*>(smem + Smem::HPieceOffset(p.h, tiles));
  float* s_wsum = reinterpret_cast<float*>(smem + Smem::WsumOffset(p.h, tiles));
  float* s_fin = reinterpret_cast<float*>(smem + Smem::FinOffset(p.h, tiles));

  const int tid = threadIdx.x, lane = tid & 31, wk = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int cta = int(blockIdx.x);
  // Gate-up: the CTA's tiles x kc records, contiguous; warp w's are [a_begin, a_end).
  const int kc = p.h / kRecordK;
  const int ra = tiles * kc;
  const int qa = (ra + kW - 1) / kW;
  const int a_begin = min(wk * qa, ra), a_end = min(a_begin + qa, ra);
  // Down: warp w's tiles w, w + kW, ... of the H / 16, rt slice records each (the CTA's 8 T columns).
  const int rt = tiles / 8;
  const int dtiles = p.h / 16;
  const int rb = (dtiles + kW - 1) / kW * rt;  // the same for every warp (records past H are empty)
  const int steps_a = qa, steps = qa + (rb + 3) / 4;
  const int64_t dn_row = int64_t(p.inter / kSliceK) * kSliceBytes;  // bytes of one down tile's records

  // The load cursor runs kDepth steps ahead of the math, across the phases (W depends on nothing).
  int ld = 0;
  const uint8_t* ga = p.w_gu + (int64_t(cta) * ra + a_begin) * kRecordBytes;  // next gate-up record
  int dn_d = wk, dn_j = 0;                                                      // next slice record
  const uint8_t* dn = p.w_down + int64_t(wk) * dn_row + int64_t(cta) * rt * kSliceBytes;
  auto load_next = [&](MlpNbitsStep& st) {
    if (ld < steps_a) {
      if (a_begin + ld < a_end) {
        const uint8_t* r = ga + 16 * lane;
#pragma unroll
        for (int j = 0; j < 4; ++j) st.w[j] = LoadStream16(r + 512 * j);
        const uint8_t* m = ga + kRecordWBytes + 4 * lane;  // metadata word 0 of this lane
        st.m[0] = make_uint2(__ldg(reinterpret_cast<const uint32_t*>(m)),
                             __ldg(reinterpret_cast<const uint32_t*>(m + 128)));
        st.m[1].x = __ldg(reinterpret_cast<const uint32_t*>(m + 256));
        ga += kRecordBytes;
      }
    } else if (ld < steps) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (dn_d < dtiles) {
          st.w[e] = LoadStream16(dn + 16 * lane);
          st.m[e] = __ldg(reinterpret_cast<const uint2*>(dn + kSliceWBytes + 8 * (8 * (t & 1) + g)));
        }
        dn += kSliceBytes;
        if (++dn_j == rt) {  // this warp's next down tile
          dn_j = 0;
          dn_d += kW;
          dn += int64_t(kW) * dn_row - int64_t(rt) * kSliceBytes;
        }
      }
    }
    ++ld;
  };
  MlpNbitsIssueX<kW>(p, s_x, tid);
  MlpNbitsStep buf[kDepth];
#pragma unroll
  for (int s = 0; s < kDepth; ++s) load_next(buf[s]);

  for (int i = tid; i < tiles * kW * 16; i += kThreadsW) s_red[i] = 0.f;  // warps without a tile's records
  MlpNbitsStageX<T, kW, kNorm>(p, s_x, s_zero, s_xpiece, s_wsum, tid, lane, wk);

  const SlotsX<T> xs(s_x, s_zero, g, t);  // the gate / up B registers (slots.cuh)
  // Down B registers: h's unit 8 j + 2 t + q of the slice where g == t, else zeros.
  const bool h_mine = g == t;
  float* part = p.partials + int64_t(cta) * p.h;

  float tot[2] = {0.f, 0.f};  // rows g, g + 8 (gate-up: of the current tile; down: of the down tile)
  int a_tile = a_begin / kc, a_c = a_begin % kc;  // the gate-up record's tile (local) and chunk
  int b_j = 0, b_d = wk;                          // the down record's slice index and tile
  for (int i0 = 0; i0 < steps; i0 += kDepth) {
#pragma unroll
    for (int s = 0; s < kDepth; ++s) {
      const int i = i0 + s;
      if (i >= steps) break;
      if (i < steps_a) {
        if (a_begin + i < a_end) {
          RecordChunk ch;
#pragma unroll
          for (int j = 0; j < 4; ++j) ch.w[j >> 1][j & 1] = buf[s].w[j];
          ch.scale[0] = buf[s].m[0].x;
          ch.scale[1] = buf[s].m[0].y;
          ch.zero = buf[s].m[1].x;
          SlotsChunk<T, F>(ch, xs, s_xpiece, a_c, t, tot);
          // The tile's last record, or this warp's: its sums into the tile's slot of this warp.
          if (a_c == kc - 1 || a_begin + i == a_end - 1) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              tot[hh] += __shfl_xor_sync(0xffffffffu, tot[hh], 1);
              tot[hh] += __shfl_xor_sync(0xffffffffu, tot[hh], 2);
            }
            if (t == 0) {
              s_red[(a_tile * kW + wk) * 16 + g] = tot[0];
              s_red[(a_tile * kW + wk) * 16 + g + 8] = tot[1];
            }
            tot[0] = tot[1] = 0.f;
          }
          if (++a_c == kc) {
            a_c = 0;
            ++a_tile;
          }
        }
        load_next(buf[s]);  // step i + kDepth into the registers just consumed
        // Every warp has the same steps_a, so every thread arrives here: h's slice from all slots.
        if (i == steps_a - 1) MlpNbitsStageH<T, kW>(s_red, s_h, s_hpiece, tiles, tid);
        continue;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (b_d >= dtiles) break;  // past this warp's last tile (uniform over the warp)
        const uint4 w = buf[s].w[e];
        float pt[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          uint32_t pg[4], p8[4];  // rows g, g + 8: the magic-number halves of word q
          MagicNibbles<T>(q == 0 ? w.x : w.y, pg);
          MagicNibbles<T>(q == 0 ? w.z : w.w, p8);
          const uint4 xv = h_mine ? s_h[8 * b_j + 2 * t + q] : make_uint4(0, 0, 0, 0);
          const uint32_t a0[4] = {pg[0], p8[0], pg[1], p8[1]};
          const uint32_t a1[4] = {pg[2], p8[2], pg[3], p8[3]};
          ptx::Mma16816Free<T>(pt, a0, xv.x, xv.y);
          ptx::Mma16816Free<T>(pt, a1, xv.z, xv.w);
        }
        // Columns 2 t + e2 are lane (2 t + e2)'s piece, in the lane's half t (lanes t >= 2: zeros).
        if (t < 2) {
          const uint2 m = buf[s].m[e];
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const float2 pc = s_hpiece[4 * b_j + 2 * t + e2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const float scale = ScaleToFloat<T>((m.x >> (16 * hh)) & 0xFFFFu);
              const float zp = float((m.y >> (8 * hh)) & 0xFFu);
              tot[hh] = __fmaf_rn(scale, pt[2 * hh + e2] - __fmaf_rn(zp, pc.y, pc.x), tot[hh]);
            }
          }
        }
        if (++b_j == rt) {  // the tile's slice is done: its 16 sums into this CTA's partials
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            tot[hh] += __shfl_xor_sync(0xffffffffu, tot[hh], 1);
            tot[hh] += __shfl_xor_sync(0xffffffffu, tot[hh], 2);
          }
          if (t == 0) {
            part[b_d * 16 + g] = tot[0];
            part[b_d * 16 + g + 8] = tot[1];
          }
          tot[0] = tot[1] = 0.f;
          b_j = 0;
          b_d += kW;
        }
      }
      load_next(buf[s]);
    }
  }

  // Every CTA's partials written: CTA c adds those of its rows in CTA order.
  cooperative_groups::this_grid().sync();
  MlpAddPartials<T, kW>(p.partials, p.h, p.residual, p.y, s_fin, tid);
}

}  // namespace joa::gemv
