// The GEMV engine's one-row path for 4-bit weights: y[1, N] = epilogue(prologue(x)[1, K] W^T) with
// W in the wide n-bit format (plan.h), scales and zero points applied once per quantisation block
// in f32 instead of once per weight.
//
// Why: with one row of x, the ring kernel (kernel.cuh) spends ~1.6 instructions a weight turning
// nibbles into (q - zp) * scale in T (lop3, sub, mul) and the MMA uses one of its eight B columns.
// Here the eight columns carry eight quantisation blocks instead ("slots"): in the k16 step of
// piece pc, lane (g, t)'s B registers hold x where g == 4 pc + t and zeros elsewhere, so column
// 4 pc + t sums only the k of lane t's piece pc (32 consecutive k), which lies in one block
// (block_size >= 32 = a piece). The A operand is the raw magic-number halves (one lop3 per two weights): f16 0x6400 | n
// = 1024 + n for low nibbles and 0x6400 | 16 n = 1024 + 16 n for high ones (x staged at 1/16 there,
// exact), bf16 0x4300 | n = 128 + n (nibble by nibble). So column s of a chunk holds
// sum (off + q) x over its piece's k, and per (row, slot)
//     sum (q - zp) x scale = scale (C - (Off_p + zp X_p)),
// with Off_p = 1024 sum(staged x) (f16) or 128 sum(x) (bf16) and X_p = sum(x) over piece p (the
// slot's 32 k, not its whole block: a block of 64+ spans several slots), both summed once per CTA
// in f32 from the staged x. Products are exact and sums f32, so the result
// differs from the reference's (one rounding of each dequantised weight to T) by less than that
// rounding; it is deterministic (fixed orders everywhere).
//
// Geometry: a CTA of kWarps warps owns 16-row tiles blockIdx.x, + gridDim.x, ...; warp w takes
// chunks [w cpp, (w + 1) cpp) of each; W goes from global memory straight into registers, kDepth
// steps ahead across tile boundaries (no shared-memory ring). x is staged once per CTA in StageX's
// fragment order (SlotsStageIssue / SlotsStageFinish: norm, nibble permutation, 1/16, per-piece
// sums), from a copy each cluster's CTAs share by multicast (sm_90a) or one each CTA makes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/convert.cuh"
#include "kernels/gemv/epilogue.cuh"
#include "kernels/gemv/kernel.cuh"  // Add8
#include "kernels/gemv/params.h"
#include "kernels/gemv/plan.h"
#include "kernels/gemv/stage.cuh"
#include "kernels/gemv/weights.cuh"
#include "kernels/prefill/sm90.cuh"
#include "kernels/ptx.cuh"

// Probes (tools/probes/gemv_lean.cu) define JOA_GEMV_MARK(phase) to time the kernel's phases.
#ifndef JOA_GEMV_MARK
#define JOA_GEMV_MARK(phase)
#endif


namespace joa::gemv {

// One chunk of a lane: rows g, g + 8 (h) x two 16-byte pieces; the scale (T bits) and zero point
// of rows g, g + 8 for the lane's two accumulator columns (slots 2t + e). Each its own register:
// packing them would make the thread wait for the loads where they are issued.
struct SlotChunk {
  uint4 w[2][2];
  uint32_t scale[2][2];  // [h][e]
  uint32_t zero[2][2];
};

// The T value in the low 16 bits of `bits`, as f32.
template <typename T>
__device__ __forceinline__ float ScaleToFloat(uint32_t bits) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  } else {
    return __uint_as_float(bits << 16);
  }
}

template <typename T>
struct SlotFormat {
  using Weights = NbitsWeights<T, 4, true>;
  static constexpr FormatInfo kF = Weights::kInfo;
  static_assert(kF.quads == 8 && kF.chunk_k == 256 && kF.lane_stride == 32 && kF.piece_stride == 128,
                "the wide 4-bit format");
  static constexpr bool kHalf = std::is_same_v<T, __half>;
  // sum (off + q) x = Off_p + sum q x: f16 1024 (x at 1/16 under the high nibbles), bf16 128.
  static constexpr float kOffset = kHalf ? 1024.f : 128.f;

  // K offset (in the chunk) of slot s = 4 piece + t: lane t's piece.
  __device__ __forceinline__ static int SlotK(int s) { return kF.lane_stride * (s & 3) + kF.piece_stride * (s >> 2); }

  // The weight-source policy of GemvSlotsKernel (RecordFormat is the other): the chunk type, a
  // per-tile cursor the load loop enters at each tile's first chunk, the next chunk of that tile
  // into registers, and the scale / zero point of (row g + 8 h, slot 2 t + e) out of a chunk.
  using Chunk = SlotChunk;
  using Cursor = int;  // the tile: this format recomputes each load's address and validity
  __device__ __forceinline__ static Cursor Enter(const GemvParams&, int tile, int, int) { return tile; }
  __device__ __forceinline__ static void Next(SlotChunk& ch, const GemvParams& p, Cursor& tile, int c, int lane) {
    Load(ch, p, tile, c, lane);
  }
  __device__ __forceinline__ static uint32_t Scale(const SlotChunk& ch, int h, int e) { return ch.scale[h][e]; }
  __device__ __forceinline__ static uint32_t Zero(const SlotChunk& ch, int h, int e) { return ch.zero[h][e]; }

  __device__ __forceinline__ static void Load(SlotChunk& ch, const GemvParams& p, int tile, int c, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const int kk = c * kF.chunk_k + kF.lane_stride * t;
    const int64_t row_bytes = int64_t(p.k) / 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = tile * 16 + g + 8 * h;
      const uint8_t* src = static_cast<const uint8_t*>(p.w) + int64_t(r) * row_bytes + kk / 2;
#pragma unroll
      for (int pc = 0; pc < 2; ++pc) {
        const bool valid = r < p.n_rows && kk + kF.piece_stride * pc < p.k;
        ch.w[h][pc] = valid ? LoadStream16(src + 64 * pc) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int b = (c * kF.chunk_k + SlotK(2 * t + e)) >> p.block_shift;
      const bool valid = b < p.k_blocks;  // K is a multiple of the block: a slot is all in or out
      const int64_t rec = (int64_t(tile) * p.k_blocks + (valid ? b : 0)) * 16 + g;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ch.scale[h][e] = valid ? uint32_t(__ldg(static_cast<const unsigned short*>(p.scales) + rec + 8 * h)) : 0u;
        ch.zero[h][e] = p.zeros != nullptr && valid ? uint32_t(__ldg(p.zeros + rec + 8 * h)) : 8u;
      }
    }
  }

  // A registers of quad q (piece q / 4, word q % 4): the magic-number halves of rows g, g + 8.
  template <class Chunk>
  __device__ __forceinline__ static void Fragments(const Chunk& ch, int q, uint32_t (&a)[2][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4& w4 = ch.w[h][q >> 2];
      const int word = q & 3;
      const uint32_t v = word == 0 ? w4.x : word == 1 ? w4.y : word == 2 ? w4.z : w4.w;
      uint32_t pr[4];  // (e0, e4), (e1, e5), (e2, e6), (e3, e7)
      MagicNibbles<T>(v, pr);
      a[0][h] = pr[0];
      a[0][2 + h] = pr[1];
      a[1][h] = pr[2];
      a[1][2 + h] = pr[3];
    }
  }
};

// One chunk of a lane in the record layout: W as in SlotChunk; the scales of rows g, g + 8 (h) for
// slots 2t, 2t + 1 as one word each (T bits, e = 0 low); the four zero points in one word (byte
// 2 h + e).
struct RecordChunk {
  uint4 w[2][2];
  uint32_t scale[2];
  uint32_t zero;
};

// The record layout (plan.h's kRecord*, jax_onnx_attn.ops.linear.to_record_layout): one record of
// kRecordBytes per (16-row tile, 256-k chunk), tile-major, holding exactly what the 32 lanes of a
// warp load for that chunk, in lane order: W word j (row g + 8 (j / 2), piece j % 2 of SlotChunk)
// of lane L at 512 j + 16 L, then metadata word m of lane L at kRecordWBytes + 128 m + 4 L (m 0 / 1:
// the scales of row g + 8 m, m 2: the zero points, absent ones stored as 8). Every warp load is
// 512 (W) or 128 (metadata) contiguous bytes, and a lane's addresses are one pointer advanced by a
// record a chunk: no per-load address math or validity tests (N % 16 == 0 and K % 256 == 0, so
// every record is whole). The same values as SlotFormat's, so the kernel's sums are the same bits.
template <typename T>
struct RecordFormat : SlotFormat<T> {
  using Chunk = RecordChunk;
  using Cursor = const uint8_t*;  // this lane's W word 0 in the next chunk's record
  __device__ __forceinline__ static Cursor Enter(const GemvParams& p, int tile, int c_begin, int lane) {
    return static_cast<const uint8_t*>(p.w) + (int64_t(tile) * p.kc + c_begin) * kRecordBytes + 16 * lane;
  }
  __device__ __forceinline__ static void Next(RecordChunk& ch, const GemvParams&, Cursor& r, int, int lane) {
#pragma unroll
    for (int j = 0; j < 4; ++j) ch.w[j >> 1][j & 1] = LoadStream16(r + 512 * j);
    const uint8_t* m = r + (kRecordWBytes - 12 * lane);  // metadata word 0 of this lane
    ch.scale[0] = __ldg(reinterpret_cast<const uint32_t*>(m));
    ch.scale[1] = __ldg(reinterpret_cast<const uint32_t*>(m + 128));
    ch.zero = __ldg(reinterpret_cast<const uint32_t*>(m + 256));
    r += kRecordBytes;
  }
  __device__ __forceinline__ static uint32_t Scale(const RecordChunk& ch, int h, int e) {
    return (ch.scale[h] >> (16 * e)) & 0xFFFFu;
  }
  __device__ __forceinline__ static uint32_t Zero(const RecordChunk& ch, int h, int e) {
    return (ch.zero >> (8 * (2 * h + e))) & 0xFFu;
  }
};

// x for one row: unit u (16 bytes) of the fragment order (stage.cuh) holds x[k(u) .. k(u) + 7].
__device__ __forceinline__ int SlotUnitK(int u) {
  return (u >> 5) * 256 + 32 * (u & 3) + 128 * ((u >> 4) & 1) + 8 * ((u >> 2) & 3);
}

// A unit of x (8 elements of K) in the slots kernels' staged form: the nibble permutation and, f16,
// 1/16 under the high nibbles (words 1 and 3: the permuted order (x0, x4 | x1, x5 | x2, x6 | x3, x7)
// meets pairs (e0, e4), (e1, e5), ...). Adds the unit's sum as staged to `staged` and as it was
// to `full` (in element order), for a piece's Off_p and X_p.
template <typename T>
__device__ __forceinline__ uint4 SlotsStageUnit(uint4 v, float& staged, float& full) {
  using F = SlotFormat<T>;
  v = PermuteForNibbles(v);
  if constexpr (F::kHalf) {
    const __half2 sixteenth = __float2half2_rn(0.0625f);
    v.y = AsU32(__hmul2(AsH2<__half>(v.y), sixteenth));
    v.w = AsU32(__hmul2(AsH2<__half>(v.w), sixteenth));
  }
  const Vec8<T> x = AsVec8<T>(v);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float f = ToFloat(x.v[e]);
    staged += f;
    full += F::kHalf && (e & 2) ? 16.f * f : f;  // halves 2, 3, 6, 7: words 1, 3
  }
  return v;
}

// Starts copying x (and gamma with the norm) into shared memory: one commit group. The thread
// copies units u = tid + i kThreads (and reads them back itself in SlotsStageFinish).
template <typename T, class Prologue>
__device__ __forceinline__ void SlotsStageIssue(const GemvParams& p, unsigned char* smem, int tid) {
  const int units = p.kc * 32;
  for (int u = tid; u < units; u += kThreads) {
    const int k = SlotUnitK(u);
    const bool valid = k < p.k;  // K is a multiple of 8: a unit is all in or out
    CpAsync16(SmemAddr(smem + int64_t(u) * 16), static_cast<const T*>(p.x) + (valid ? k : 0), valid);
    if constexpr (Prologue::kNorm) {
      CpAsync16(SmemAddr(smem + p.gamma_offset + int64_t(u) * 16), static_cast<const T*>(p.gamma) + (valid ? k : 0),
                valid);
    }
  }
  CpAsyncCommit();
}

// Waits for x, applies the norm (its statistics: each thread's units, the warps' sums added in
// warp order, so every thread computes the same inverse RMS) and the staged form (SlotsStageUnit);
// then per 32-element piece of K (k / 32), Off_p and X_p into s_piece. A warp holds one chunk (32
// units); a piece's four units are the lanes that differ in bits 2-3 (the quad), summed by a
// butterfly over those (a fixed order). Ends with the units written but not yet visible to other
// threads: the caller synchronises.
// raw_x / raw_g: x and gamma as they are in memory (the cluster's multicast landed them), read
// at k(u); null: the units were copied in place by SlotsStageIssue.
template <typename T, class Prologue>
__device__ __forceinline__ void SlotsStageFinish(const GemvParams& p, unsigned char* smem, float* s_wsum,
                                                 float2* s_piece, int tid, const unsigned char* raw_x,
                                                 const unsigned char* raw_g) {
  using F = SlotFormat<T>;
  const int units = p.kc * 32;  // a multiple of 32: whole warps
  const int lane = tid & 31, warp = tid >> 5;
  auto x_unit = [&](int u) -> uint4 {
    if (raw_x == nullptr) return *reinterpret_cast<const uint4*>(smem + int64_t(u) * 16);
    const int k = SlotUnitK(u);
    return k < p.k ? *reinterpret_cast<const uint4*>(raw_x + int64_t(k) * 2) : make_uint4(0, 0, 0, 0);
  };
  auto g_unit = [&](int u) -> uint4 {
    if (raw_g == nullptr) return *reinterpret_cast<const uint4*>(smem + p.gamma_offset + int64_t(u) * 16);
    const int k = SlotUnitK(u);
    return k < p.k ? *reinterpret_cast<const uint4*>(raw_g + int64_t(k) * 2) : make_uint4(0, 0, 0, 0);
  };
  if (raw_x == nullptr) CpAsyncWaitPending(0);
  float r = 0.f;
  if constexpr (Prologue::kNorm) {
    float ss = 0.f;
    for (int u = tid; u < units; u += kThreads) ss = AddSquares8<T>(x_unit(u), ss);
    r = OneRowInverseRms(ss, s_wsum, lane, warp, p.k, p.eps);
  }
  for (int u = tid; u < units; u += kThreads) {
    uint4* unit = reinterpret_cast<uint4*>(smem + int64_t(u) * 16);
    uint4 v = x_unit(u);
    if constexpr (Prologue::kNorm) v = Prologue::template Apply<T>(v, r, g_unit(u));
    float staged = 0.f, full = 0.f;
    *unit = SlotsStageUnit<T>(v, staged, full);
#pragma unroll
    for (int m = 4; m <= 8; m <<= 1) {
      staged += __shfl_xor_sync(0xffffffffu, staged, m);
      full += __shfl_xor_sync(0xffffffffu, full, m);
    }
    if ((lane & 12) == 0) s_piece[SlotUnitK(u) >> 5] = make_float2(F::kOffset * (F::kHalf ? staged : full), full);
  }
}

// Shared memory of the slots kernel past StageX's areas (ring_offset): 512 zero bytes, Off_p / X_p
// per 32-element piece of K (8 a chunk), then (multicast) x and gamma as in memory, then the
// multicast's barrier.
__host__ __device__ inline int SlotsRawOffset(const GemvParams& p) { return p.ring_offset + 512 + p.kc * 64; }
__host__ __device__ inline int SlotsBarrierOffset(const GemvParams& p, bool norm) {
  return SlotsRawOffset(p) + p.kc * 512 * (norm ? 2 : 1);
}
__host__ __device__ inline int SlotsSmemBytes(const GemvParams& p, bool norm) { return SlotsBarrierOffset(p, norm) + 16; }

// Chunks a warp has in flight (registers): 2 and 3 measured alike on the ~1B shapes, 4 slower
// (each warp's extra loads wait to issue behind the SM's requests in flight).
inline constexpr int kSlotsDepth = 2;
// Accumulator chains a chunk's 16 MMAs are dealt over (probe: 1, 2, 4 chains: 2 best by ~1.5%).
inline constexpr int kChains = 2;

// A lane's B registers of a chunk, piece pc: x where g == 4 pc + t, else the zero area (512 bytes,
// the same quad offsets).
template <typename T>
struct SlotsX {
  const unsigned char* base[2];
  int step[2];  // bytes per chunk

  __device__ __forceinline__ SlotsX(const unsigned char* s_x, const unsigned char* s_zero, int g, int t) {
#pragma unroll
    for (int pc = 0; pc < 2; ++pc) {
      const bool mine = g == 4 * pc + t;
      base[pc] = (mine ? s_x : s_zero) + 16 * t;
      step[pc] = mine ? SlotFormat<T>::kF.quads * 64 : 0;
    }
  }
  __device__ __forceinline__ uint4 Quad(int c, int q) const {
    const int pc = q >> 2;
    return *reinterpret_cast<const uint4*>(base[pc] + c * step[pc] + 64 * (q & 3) + 256 * pc);
  }
};

// Chunk c of a lane (Src's Chunk, Src = SlotFormat<T> or RecordFormat<T>): its 16 MMAs against the
// staged x, then per (row g + 8 h, slot 2 t + e) the scale and zero point applied in f32 into tot[h]
// with the slot's Off_p / X_p (s_piece).
template <typename T, class Src, class Chunk>
__device__ __forceinline__ void SlotsChunk(const Chunk& ch, const SlotsX<T>& xs, const float2* s_piece, int c, int t,
                                           float (&tot)[2]) {
  using F = Src;
  // kChains accumulator chains (quad q in chain q % kChains), summed in a fixed order: the MMAs of
  // one chain each wait for the one before.
  float part[kChains][4] = {};
#pragma unroll
  for (int q = 0; q < F::kF.quads; ++q) {
    uint32_t a[2][4];
    F::Fragments(ch, q, a);
    const uint4 xv = xs.Quad(c, q);
    ptx::Mma16816Free<T>(part[q % kChains], a[0], xv.x, xv.y);
    ptx::Mma16816Free<T>(part[q % kChains], a[1], xv.z, xv.w);
  }
  float acc[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[i] = part[0][i];
#pragma unroll
    for (int k = 1; k < kChains; ++k) acc[i] += part[k][i];
  }
  // Columns 2t + e of rows g (acc[e]) and g + 8 (acc[2 + e]): one piece each.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float2 blk = s_piece[(c * F::kF.chunk_k + F::SlotK(2 * t + e)) >> 5];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float scale = ScaleToFloat<T>(Src::Scale(ch, h, e));
      const float zp = float(Src::Zero(ch, h, e));
      tot[h] = __fmaf_rn(scale, acc[2 * h + e] - __fmaf_rn(zp, blk.y, blk.x), tot[h]);
    }
  }
}

// Src: where W and its scales / zero points come from, SlotFormat<T> (the wide format, tiled
// metadata) or RecordFormat<T> (the record layout); everything else is the same kernel.
template <typename T, class Src, class Prologue, class Epilogue, int kDepth>
__global__ void __launch_bounds__(kThreads, 2) GemvSlotsKernel(const __grid_constant__ GemvParams p) {
  using F = Src;
  using Chunk = typename Src::Chunk;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* s_x = smem;
  float* s_red = reinterpret_cast<float*>(smem + p.x_bytes);  // [2][kWarps][red_stride]
  // After StageX's areas (x | reductions | norm | gamma): 512 zero bytes (the B registers of lanes
  // whose slot is not the current piece's), then Off_p, X_p per piece.
  unsigned char* s_zero = smem + p.ring_offset;
  float2* s_piece = reinterpret_cast<float2*>(s_zero + 512);

  const int tid = threadIdx.x, lane = tid & 31, wk = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int c_begin = wk * p.cpp;
  const int tiles = (p.blocks - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x);
  const int steps = tiles * p.cpp;  // the same for every warp (steps past K are empty)

  JOA_GEMV_MARK(0);
  ptx::LaunchDependents();

  Chunk buf[kDepth];
  int ld_step = 0, ld_it = 0, ld_j = 0;
  typename Src::Cursor cursor{};
  auto load_next = [&](Chunk& dst) {
    if (ld_step < steps && c_begin + ld_j < p.kc) {
      if (ld_j == 0) cursor = Src::Enter(p, int(blockIdx.x) + ld_it * int(gridDim.x), c_begin, lane);
      Src::Next(dst, p, cursor, c_begin + ld_j, lane);
    }
    ++ld_step;
    if (++ld_j == p.cpp) {
      ld_j = 0;
      ++ld_it;
    }
  };
  // With a cluster (sm_90), each CTA asks L2 for 1/cluster of x (and gamma) and multicasts it to
  // all: every CTA reading all of x was the call's longest wait (probe: one 4-8 KB vector read by
  // 128-264 CTAs took 2-5 us to arrive; 1.5 us with a copy of it per CTA). Without, each CTA
  // copies x itself (cp.async), x's copies first: W requested earlier would hold them up.
  unsigned char* raw_x = nullptr;
  unsigned char* raw_g = nullptr;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // the multicast: sm_90a
  const bool multicast = p.cluster > 1;
#else
  const bool multicast = false;  // each CTA copies x (the plan gives clusters on sm_90 only)
#endif
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint32_t bar = SmemAddr(smem + SlotsBarrierOffset(p, Prologue::kNorm));
  if (multicast) {
    raw_x = smem + SlotsRawOffset(p);
    raw_g = raw_x + p.kc * 512;
    if (tid == 0) {
      sm90::MbarInit(bar, 1);
      sm90::FenceBarrierInit();
    }
    // Every CTA's barrier exists before any multicast signals it (the init fence orders it): a
    // relaxed arrival, as a release one (MEMBAR.GPU) would wait for every load in flight.
    sm90::ClusterArriveRelaxed();
    sm90::ClusterWait();
    ptx::WaitForPrimary();
    if (tid == 0) {
      const uint32_t bytes = uint32_t(p.k) * 2;
      sm90::MbarArriveExpectTx(bar, Prologue::kNorm ? 2 * bytes : bytes);
      const int rank = ClusterRank(p.cluster), n16 = p.k / 8;
      const int a = rank * n16 / p.cluster, b = (rank + 1) * n16 / p.cluster;
      const uint16_t mask = uint16_t((1u << p.cluster) - 1);
      if (b > a) {
        sm90::BulkLoadMulticast(SmemAddr(raw_x + 16 * a), static_cast<const uint8_t*>(p.x) + 16 * a, 16 * (b - a), bar,
                                mask);
        if constexpr (Prologue::kNorm) {
          sm90::BulkLoadMulticast(SmemAddr(raw_g + 16 * a), static_cast<const uint8_t*>(p.gamma) + 16 * a,
                                  16 * (b - a), bar, mask);
        }
      }
    }
  }
#endif
  JOA_GEMV_MARK(7);
  if (!multicast && p.x_first) {
    ptx::WaitForPrimary();
    SlotsStageIssue<T, Prologue>(p, smem, tid);
  }
#pragma unroll
  for (int s = 0; s < kDepth; ++s) load_next(buf[s]);
  JOA_GEMV_MARK(1);
  if (!multicast && !p.x_first) {
    ptx::WaitForPrimary();  // x, gamma, bias, residual may come from the previous kernel
    SlotsStageIssue<T, Prologue>(p, smem, tid);
  }
  for (int i = tid; i < 512 / 16; i += kThreads) reinterpret_cast<uint4*>(s_zero)[i] = make_uint4(0, 0, 0, 0);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // the multicast: sm_90a
  if (multicast) {
    sm90::MbarWait(bar, 0);
    // Waited for at the end: no CTA exits while its multicast may still land. Relaxed: a release
    // arrival here waited for the W chunks just requested, holding x's staging back until W landed.
    sm90::ClusterArriveRelaxed();
  }
#endif
  JOA_GEMV_MARK(2);
  SlotsStageFinish<T, Prologue>(p, smem, s_red, s_piece, tid, raw_x, raw_g);
  __syncthreads();
  JOA_GEMV_MARK(3);
  // The epilogue's once-a-CTA reads (after the programmatic wait above), in flight while the first
  // tile streams.
  using Ahead = OneRowAhead<T, Epilogue>;
  const Ahead ahead = tid < Epilogue::OutCols(16) / 8 ? Ahead::Read(p, int(blockIdx.x)) : Ahead{};

  const SlotsX<T> xs(s_x, s_zero, g, t);

  const int rs = p.red_stride;
  float tot[2] = {0.f, 0.f};  // rows g, g + 8
  int j = 0, it = 0;
  for (int i0 = 0; i0 < steps; i0 += kDepth) {
#pragma unroll
    for (int s = 0; s < kDepth; ++s) {
      if (i0 + s >= steps) break;
      const int c = c_begin + j;
      if (c < p.kc) {
        SlotsChunk<T, Src>(buf[s], xs, s_piece, c, t, tot);
      }
      JOA_GEMV_MARK(4);
      load_next(buf[s]);  // step i + kDepth into the registers just consumed
      if (++j < p.cpp) continue;
      j = 0;
      // End of a tile: the four lanes of a row sum their slots (fixed order), lane t = 0 writes the
      // warp's partial sums; the epilogue's threads add the warps in order.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tot[h] += __shfl_xor_sync(0xffffffffu, tot[h], 1);
        tot[h] += __shfl_xor_sync(0xffffffffu, tot[h], 2);
      }
      const int tile = int(blockIdx.x) + it * int(gridDim.x);
      float* red = s_red + (it & 1) * kWarps * rs;
      ++it;
      if (t == 0) {
        red[wk * rs + g] = tot[0];
        red[wk * rs + g + 8] = tot[1];
      }
      tot[0] = tot[1] = 0.f;
      __syncthreads();
      OneRowTileEpilogue<T, Epilogue>(p, tile, red, rs, tid, ahead);
      JOA_GEMV_MARK(5);
    }
  }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // the multicast: sm_90a
  if (multicast) sm90::ClusterWait();
#endif
  JOA_GEMV_MARK(6);
}

}  // namespace joa::gemv
