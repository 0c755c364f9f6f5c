// The split-KV decode engine: one CTA per (split, KV head x M block, batch row).
//
// DecodeSplitKernel runs five named stages (SplitStages below), in this order:
//   load     Q rows into shared memory once; K / V tiles through a cp.async ring (quantised tiles
//            converted to T after they land);
//   QK       S = Q K^T of a chunk of a tile's columns, then the variant's mask and score (inline);
//   softmax  the online softmax update of the rows' max, sum and O;
//   PV       O += P V of the chunk;
//   combine  the warps that share rows merge (max, sum, O) in a fixed order, then the CTA writes
//            its output, its split's partial, or its cluster share (cluster_combine.cuh).
//
// A CTA holds its packed query rows (G heads x S rows of one KV head) in shared memory and streams
// the KV tiles of its split through a cp.async ring of kStages stages (16-byte copies, zero fill
// past the valid rows, so unwritten cache rows are never read); an int8 / int4 cache (the Kv policy,
// kv_format.cuh) streams its packed bytes and converts each landed tile into one T tile pair that
// the same MMA code reads (or, with LaunchOptions::quant_regs, DecodeSplitKernelQRegs of
// engine_qregs.cuh builds the MMA fragments from the raw bytes in registers). Warps are laid out
// kWarpsM x kWarpsN:
// each owns 16 query rows and a 1 / kWarpsN slice of every KV tile, runs S = Q K^T and O += P V on
// mma.sync m16n8k16 (f32 accumulation) with an online softmax, and the warps that share rows merge
// their (max, sum, O) through shared memory at the end in a fixed order. With one split the CTA
// writes the normalised output (sinks applied); otherwise the split's normalised partial and its
// log2-sum-exp go to the workspace for DecodeCombineKernel (combine.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/kv_format.cuh"
#include "kernels/common/variant.cuh"
#include "kernels/convert.cuh"
#include "kernels/decode/cluster_combine.cuh"
#include "kernels/decode/params.h"
#include "kernels/decode/plan.h"
#include "kernels/ptx.cuh"
#include "kernels/sm90_pipe.cuh"

namespace joa::decode {

// Whether this compilation pass emits sm_90 instructions (mbarrier.try_wait): false in the
// sm_80 pass, where a producer-warp kernel (DenseProducerKv) is a trap the launcher never reaches.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
inline constexpr bool kSm90Pass = false;
#else
inline constexpr bool kSm90Pass = true;
#endif

// The tiling of one layout, as compile-time constants: the values of plan.h's MakeLayout (the one
// definition, which the planner reads too) and the checks that they fit.
template <typename T, int kD, int kWarpsM, int kWarpsN, class Kv = DenseKv<T>>
struct EngineConfig {
  static_assert(kD % 16 == 0, "head dim must be a multiple of 16");
  static constexpr Layout kLayout = MakeLayout(kD, kWarpsM, kWarpsN, int(sizeof(T)),
                                               Kv::kQuantized ? Kv::kBits : 0, Kv::kInRegs, Kv::kProducer,
                                               Kv::kTileRows);
  static constexpr int kWarps = kLayout.warps;      // the warps that compute
  static constexpr int kThreads = kLayout.threads;  // their threads
  // With a producer warp (Kv::kProducer) the CTA has one warp more, warp kWarps, threads
  // [kThreads, kLaunchThreads): it issues the ring's copies and takes part in the CTA barriers of
  // the combine, nothing else.
  static constexpr bool kProducer = kLayout.producer;
  static constexpr int kLaunchThreads = kLayout.launch_threads;
  static constexpr int kBarOffset = kLayout.bar_offset;
  static_assert(!kProducer || kLayout.ctas_per_sm ==
                                  MakeLayout(kD, kWarpsM, kWarpsN, int(sizeof(T)), 0, false, false).ctas_per_sm,
                "a producer layout must keep the CTAs per SM the planner counted");
  static_assert(!kProducer || kLayout.stages <= kMaxProducerStages, "the producer's barriers are reserved");
  static constexpr int kBlockM = kLayout.block_m;
  static constexpr int kTileN = kLayout.tile_n;
  // The planner's splits of this layout are whole tiles (a wide tile: MakePlan's wide splits).
  static_assert(SplitBlockRows(kLayout) % kTileN == 0, "split sizes must be whole tiles");
  static_assert(Kv::kTileRows == 0 || (kWarpsM == 1 && kWarpsN == 4), "the wide tile is the 1 x 4 layout's");
  static constexpr int kWarpN = kLayout.warp_n;
  static_assert(kWarpN % 16 == 0, "a warp's KV slice must be whole k16 steps of P V");
  static constexpr int kChunk = kLayout.chunk;
  static constexpr bool kQInRegs = kLayout.q_in_regs;
  static constexpr int kStride = kLayout.stride;  // Q
  // K / V tiles: rows of kTileStride, 16-byte chunks XOR-swizzled by row % 8 where kSwizzle
  // (plan.h's Layout::swizzle; SplitStages::TileElem).
  static constexpr bool kSwizzle = kLayout.swizzle;
  static constexpr int kTileStride = kLayout.tile_stride;
  static_assert(!kSwizzle || kD % 64 == 0, "the swizzle permutes whole 128-byte lines");
  static constexpr int kOStride = kLayout.o_stride;
  static constexpr int kVecs = kD / 8;  // 16-byte vectors per row
  static constexpr int kQBytes = kLayout.q_bytes;
  static constexpr int kTileElems = kLayout.tile_elems;
  static constexpr int kStageBytes = kLayout.stage_bytes;
  static constexpr int kConvBytes = kLayout.conv_bytes;
  static constexpr int kKPitch = kLayout.k_pitch, kVPitch = kLayout.v_pitch;  // in registers only
  static constexpr int kRingOffset = kLayout.ring_offset;
  static constexpr int kMergeBytes = kLayout.merge_bytes;
  static constexpr int kCtasPerSm = kLayout.ctas_per_sm;
  static constexpr int kStages = kLayout.stages;
  static_assert(kStages >= 2, "the pipeline needs two stages");
  static constexpr int kPipeBytes = kLayout.pipe_bytes;
  static constexpr int kSmemBytes = kLayout.smem_bytes;
  static_assert(kSmemBytes <= SmemBudget(kCtasPerSm), "shared memory over budget");
  static constexpr bool kClusterCombine = kLayout.cluster_combine;
};

// The stages of DecodeSplitKernel. Every function is inlined into the kernel: they name the steps,
// they do not move work between them.
template <typename T, int kD, int kWarpsM, int kWarpsN, class Kv>
struct SplitStages {
  using Cfg = EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>;
  static constexpr int kBlockM = Cfg::kBlockM, kStride = Cfg::kStride, kStages = Cfg::kStages;
  static constexpr int kChunk = Cfg::kChunk, kThreads = Cfg::kThreads, kTileN = Cfg::kTileN;
  // Score fragments of one chunk: kChunk / 8 n8 tiles of the mma accumulator layout.
  using Scores = float[kChunk / 8][4];
  // The O accumulators of the thread's two rows (kD / 8 n8 tiles).
  using Out = float[kD / 8][4];

  // --- load ------------------------------------------------------------------------------------

  // The element offset of 16-byte chunk `chunk` of row `row` in this layout's K / V tiles
  // (params.h's TileElem: rows kTileStride apart, swizzled where Cfg::kSwizzle).
  static __device__ __forceinline__ int TileElem(int row, int chunk) {
    return joa::TileElem(Cfg::kSwizzle, Cfg::kTileStride, row, chunk);
  }

  // Copies rows [0, kRows) of a [kRows, kD] tile whose row i is at src + i * row_stride into the
  // tile layout at dst (TileElem); rows outside [valid_lo, valid_hi) become zeros.
  template <int kRows>
  static __device__ __forceinline__ void LoadRows(T* dst, const T* src, int64_t row_stride, int valid_lo,
                                                  int valid_hi, int tid) {
    constexpr int kVecs = kD / 8;
    constexpr int kTotal = kRows * kVecs;
    constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = tid + it * kThreads;
      if (kTotal % kThreads == 0 || c < kTotal) {
        const int r = c / kVecs;
        const int col = (c % kVecs) * 8;
        const bool valid = r >= valid_lo && r < valid_hi;
        const T* g = valid ? src + r * row_stride + col : src;
        ptx::CpAsync16(ptx::SmemAddr(dst + TileElem(r, c % kVecs)), g, valid);
      }
    }
  }

  // Q rows of the CTA: packed row R = g * S + i is q[b, kvh * G + g, i]; rows past M are zeros.
  // kCopyThreads threads copy (tid < kCopyThreads).
  template <int kCopyThreads = kThreads>
  static __device__ __forceinline__ void LoadQ(T* s_q, const DecodeParams& p, int b, int kvh, int row0,
                                               int tid) {
    constexpr int kTotal = kBlockM * Cfg::kVecs;
    for (int c = tid; c < kTotal; c += kCopyThreads) {
      const int r = c / Cfg::kVecs, col = (c % Cfg::kVecs) * 8;
      const int R = row0 + r;
      const bool valid = R < p.rows;
      const T* src = static_cast<const T*>(p.q);
      if (valid) {
        const int h = kvh * p.group + R / p.q_len, i = R % p.q_len;
        src += b * p.q_stride_b + h * p.q_stride_h + i * p.q_stride_s + col;
      }
      ptx::CpAsync16(ptx::SmemAddr(s_q + r * kStride + col), src, valid);
    }
  }

  // Issues the copies of KV tile t (rows [n0, n0 + kTileN), n0 = t * kTileN) into ring stage st;
  // rows outside [n_begin, n_end) are zero-filled and not read.
  static __device__ __forceinline__ void LoadKvTile(int t, int st, const DecodeParams& p, int b, int kvh,
                                                    const T* k_base, const T* v_base, T* s_kv,
                                                    unsigned char* s_ring, int n_begin, int n_end,
                                                    int tid) {
    const int n0 = t * kTileN;
    if constexpr (Kv::kQuantized) {
      // Strides of a quantized cache count bytes.
      const unsigned char* k_raw = static_cast<const unsigned char*>(p.k) + b * p.k_stride_b +
                                   kvh * p.k_stride_h + n0 * p.k_stride_n;
      const unsigned char* v_raw = static_cast<const unsigned char*>(p.v) + b * p.v_stride_b +
                                   kvh * p.v_stride_h + n0 * p.v_stride_n;
      Kv::template LoadTile<kD, kTileN, kThreads>(s_ring + st * Cfg::kStageBytes, k_raw, v_raw,
                                                  p.k_stride_n, p.v_stride_n, n_begin - n0,
                                                  n_end - n0, tid);
    } else {
      T* s_k = s_kv + (2 * st) * Cfg::kTileElems;
      LoadRows<kTileN>(s_k, k_base + n0 * p.k_stride_n, p.k_stride_n, n_begin - n0, n_end - n0, tid);
      LoadRows<kTileN>(s_k + Cfg::kTileElems, v_base + n0 * p.v_stride_n, p.v_stride_n, n_begin - n0,
                       n_end - n0, tid);
    }
  }

  // Issues the copies of KV tile t into ring stage st like LoadKvTile, for a cache whose rows are
  // contiguous (Kv::kCursor: row stride kD): the tile is one block of kTileN * kD values, and copy
  // c = tid + i * kThreads is the 16 bytes at value 8 c of it, i.e. the thread's place plus an
  // immediate. Only a tile that crosses [n_begin, n_end) tests its rows.
  static __device__ __forceinline__ void LoadKvTileByCursor(int t, int st, const T* k_base, const T* v_base,
                                                            T* s_kv, int n_begin, int n_end, int tid) {
    const int n0 = t * kTileN;
    const int64_t tile = int64_t(n0) * kD;
    T* s_k = s_kv + (2 * st) * Cfg::kTileElems;
    if (n0 >= n_begin && n0 + kTileN <= n_end) {
      CopyTileByCursor<false>(s_k, k_base + tile, 0, kTileN, tid);
      CopyTileByCursor<false>(s_k + Cfg::kTileElems, v_base + tile, 0, kTileN, tid);
    } else {
      CopyTileByCursor<true>(s_k, k_base + tile, n_begin - n0, n_end - n0, tid);
      CopyTileByCursor<true>(s_k + Cfg::kTileElems, v_base + tile, n_begin - n0, n_end - n0, tid);
    }
  }

  // One [kTileN, kD] tile whose row 0 is at `tile` (contiguous rows) into dst (TileElem's layout);
  // kTestRows: rows outside [valid_lo, valid_hi) become zeros and are not read (the copy points at
  // row 0, which a tile always has in range). kCopyThreads threads copy (tid < kCopyThreads): the
  // CTA's compute threads, or the 32 lanes of a producer warp.
  template <bool kTestRows, int kCopyThreads = kThreads>
  static __device__ __forceinline__ void CopyTileByCursor(T* dst, const T* tile, int valid_lo, int valid_hi,
                                                          int tid) {
    constexpr int kVecs = kD / 8;
    constexpr int kTotal = kTileN * kVecs;
    constexpr int kIters = (kTotal + kCopyThreads - 1) / kCopyThreads;
    // Where a copy's row moves by whole rows from one to the next (kCopyThreads a multiple of kVecs),
    // and by whole swizzle periods (8 rows) where the tile is swizzled, its shared-memory address is
    // the first one plus an immediate too.
    constexpr int kStep = kCopyThreads % kVecs == 0 ? kCopyThreads / kVecs : 0;
    constexpr int kRowStep = Cfg::kSwizzle && kStep % 8 != 0 ? 0 : kStep;
    const T* mine = tile + 8 * tid;
    const uint32_t s_mine = ptx::SmemAddr(dst + TileElem(tid / kVecs, tid % kVecs));
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = tid + it * kCopyThreads;
      if (kTotal % kCopyThreads == 0 || c < kTotal) {
        const int r = c / kVecs;
        const uint32_t s = kRowStep ? s_mine + uint32_t(it * kRowStep * Cfg::kTileStride * sizeof(T))
                                    : ptx::SmemAddr(dst + TileElem(r, c % kVecs));
        if constexpr (kTestRows) {
          const bool valid = r >= valid_lo && r < valid_hi;
          ptx::CpAsync16(s, valid ? mine + it * kCopyThreads * 8 : tile, valid);
        } else {
          ptx::CpAsync16(s, mine + it * kCopyThreads * 8, true);
        }
      }
    }
  }

  // --- load by a producer warp (Kv::kProducer; sm_90) ---------------------------------------------
  //
  // The producer warp issues the ring's copies: the same 16-byte cp.async copies as the compute
  // warps' (zero fill outside the visible rows, rows contiguous: LoadKvTileByCursor's addressing),
  // so the MMAs read the same tiles and give the same bits. Stage s is guarded by two mbarriers at
  // the end of shared memory (Cfg::kBarOffset): full[s], which each producer lane arrives on once
  // its copies of the stage have landed (cp.async.mbarrier.arrive.noinc: 32 arrivals a phase), and
  // empty[s], which each compute warp arrives on once done with the stage (kWarps arrivals). Round
  // k of stage s is phase k of both: the compute warps wait on full[s] with parity k & 1, the
  // producer on empty[s] with parity (k & 1) ^ 1 (a fresh barrier passes parity 1 at once). Q has
  // its own barrier (32 arrivals, one phase).
  //
  // Not bulk copies (cp.async.bulk, one a padded row): its operands are warp-uniform registers, so
  // 32 lanes' rows compile to a loop of 32 single-lane issues (ELECT, R2UR, UBLKCP, BRA.U.ANY):
  // ~1000 issue slots a 64-row tile against ~40 here (sm_90a SASS, d64 / d128).

  static __device__ __forceinline__ uint32_t QFull(uint32_t bars) { return bars; }
  static __device__ __forceinline__ uint32_t Full(uint32_t bars, int st) { return bars + 8 * (1 + st); }
  static __device__ __forceinline__ uint32_t Empty(uint32_t bars, int st) {
    return bars + 8 * (1 + kStages + st);
  }

  // One lane of the producer warp (lane 0) sets the barriers up; the CTA barrier that follows
  // publishes them.
  static __device__ __forceinline__ void InitBarriers(uint32_t bars) {
    sm90::MbarInit(QFull(bars), 32);
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      sm90::MbarInit(Full(bars, st), 32);
      sm90::MbarInit(Empty(bars, st), Cfg::kWarps);
    }
    sm90::FenceBarrierInit();
  }

  // LoadQ by the producer warp's 32 lanes, landing on the Q barrier.
  static __device__ __forceinline__ void ProduceQ(T* s_q, const DecodeParams& p, int b, int kvh, int row0,
                                                  uint32_t bars, int lane) {
    LoadQ<32>(s_q, p, b, kvh, row0, lane);
    ptx::CpAsyncMbarArrive(QFull(bars));
  }

  // The split's KV tiles [t_begin, t_end) into the ring, in order, by the producer warp: for each,
  // wait until the compute warps have released its stage, then LoadKvTileByCursor's copies by 32
  // lanes, landing on the stage's full barrier.
  static __device__ __forceinline__ void ProduceKv(const T* k_base, const T* v_base, T* s_kv, uint32_t bars,
                                                   int t_begin, int t_end, int n_begin, int n_end, int lane) {
    int st = 0;
    uint32_t ph = 0;
    for (int t = t_begin; t < t_end; ++t) {
      const int n0 = t * kTileN;
      const int64_t tile = int64_t(n0) * kD;
      T* s_k = s_kv + (2 * st) * Cfg::kTileElems;
      sm90::MbarWait(Empty(bars, st), ph ^ 1u);  // every compute warp is done with round k - 1
      if (n0 >= n_begin && n0 + kTileN <= n_end) {
        CopyTileByCursor<false, 32>(s_k, k_base + tile, 0, kTileN, lane);
        CopyTileByCursor<false, 32>(s_k + Cfg::kTileElems, v_base + tile, 0, kTileN, lane);
      } else {
        CopyTileByCursor<true, 32>(s_k, k_base + tile, n_begin - n0, n_end - n0, lane);
        CopyTileByCursor<true, 32>(s_k + Cfg::kTileElems, v_base + tile, n_begin - n0, n_end - n0, lane);
      }
      ptx::CpAsyncMbarArrive(Full(bars, st));
      if (++st == kStages) {
        st = 0;
        ph ^= 1u;
      }
    }
  }

  // --- QK ----------------------------------------------------------------------------------------

  // A lane's ldmatrix offsets into a K or V tile (bytes), for 16-byte chunk pairs 2 r + b (r < 4)
  // of its row `row` (b = col / 8: the lane's half of a k16 step) in TileElem's layout. Chunk pair
  // 2 kk + b lies at 128 (kk / 4) bytes past pair 2 (kk % 4) + b: the swizzle XORs a row's chunks
  // with row % 8 < 8, so it permutes within each 8-chunk (128-byte) line; rows a multiple of 8 on
  // keep the phase. So a tile's reads are these four registers plus immediates.
  static __device__ __forceinline__ void LaneOffsets(uint32_t (&off)[4], int row, int col) {
#pragma unroll
    for (int r = 0; r < 4; ++r) off[r] = uint32_t(TileElem(row, 2 * r + (col >> 3)) * sizeof(T));
  }

  // s = Q K^T for the kChunk tile columns from c0 (a multiple of 8; k_off: the lane's LaneOffsets
  // in the K tile). Q comes from registers (qa) or, at d256, from shared memory at q_addr.
  template <int kQRegs>
  static __device__ __forceinline__ void Qk(Scores& s, const uint32_t (&qa)[kQRegs][4], uint32_t q_addr,
                                            const T* s_k, int c0, const uint32_t (&k_off)[4]) {
    const uint32_t k_base = ptx::SmemAddr(s_k + c0 * Cfg::kTileStride);
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    // Fully unrolled with Q in registers; at d256 (Q from shared memory) partly, which keeps the
    // compiler from hoisting every K fragment of the chunk into registers and spilling O.
    constexpr int kUnrollK = Cfg::kQInRegs ? kD / 16 : 4;
#pragma unroll kUnrollK
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t a[4];
      if constexpr (Cfg::kQInRegs) {
        a[0] = qa[kk][0]; a[1] = qa[kk][1]; a[2] = qa[kk][2]; a[3] = qa[kk][3];
      } else {
        ptx::LdMatrixX4(a, q_addr + kk * 32);
      }
#pragma unroll
      for (int np = 0; np < kChunk / 16; ++np) {
        uint32_t bk[4];
        ptx::LdMatrixX4(bk, k_base + k_off[kk % 4] +
                                uint32_t((np * 16 * Cfg::kTileStride + 64 * (kk / 4)) * sizeof(T)));
        ptx::Mma16816<T>(s[2 * np], a, bk[0], bk[1]);
        ptx::Mma16816<T>(s[2 * np + 1], a, bk[2], bk[3]);
      }
    }
  }

  // --- softmax update ----------------------------------------------------------------------------

  // The online softmax over a chunk, per row (the 4 lanes of a quad share a row): the new max m,
  // s -> exp2(s - m), the running sum l and the rescale of O.
  static __device__ __forceinline__ void SoftmaxUpdate(Scores& s, float (&m)[2], float (&l)[2], Out& o) {
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kChunk / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r2], s[nt][2 * r2 + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r2], mx);
      // A row with no visible key yet keeps max -inf; shifting by 0 keeps exp2 at 0, not NaN.
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float corr = ptx::Exp2(m[r2] - m_use);
      m[r2] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kChunk / 8; ++nt) {
        s[nt][2 * r2] = ptx::Exp2(s[nt][2 * r2] - m_use);
        s[nt][2 * r2 + 1] = ptx::Exp2(s[nt][2 * r2 + 1] - m_use);
        sum += s[nt][2 * r2] + s[nt][2 * r2 + 1];
      }
      l[r2] = l[r2] * corr + sum;
      // Once a row's max settles (most chunks of a long context) corr is exactly 1: skip the
      // kD / 4 multiplies.
      if (corr != 1.f) {
#pragma unroll
        for (int dt = 0; dt < kD / 8; ++dt) {
          o[dt][2 * r2] *= corr;
          o[dt][2 * r2 + 1] *= corr;
        }
      }
    }
  }

  // --- PV ----------------------------------------------------------------------------------------

  // O += P V: two adjacent n8 score tiles form the A operand of one k16 step (v_off: the lane's
  // LaneOffsets in the V tile, read transposed).
  static __device__ __forceinline__ void Pv(const Scores& s, Out& o, const T* s_v, int c0,
                                            const uint32_t (&v_off)[4]) {
    const uint32_t v_base = ptx::SmemAddr(s_v + c0 * Cfg::kTileStride);
#pragma unroll
    for (int kc = 0; kc < kChunk / 16; ++kc) {
      const uint32_t pa[4] = {ptx::Pack2<T>(s[2 * kc][0], s[2 * kc][1]),
                              ptx::Pack2<T>(s[2 * kc][2], s[2 * kc][3]),
                              ptx::Pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                              ptx::Pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int dp = 0; dp < kD / 16; ++dp) {
        uint32_t bv[4];
        ptx::LdMatrixX4Trans(bv, v_base + v_off[dp % 4] +
                                     uint32_t((kc * 16 * Cfg::kTileStride + 64 * (dp / 4)) * sizeof(T)));
        ptx::Mma16816<T>(o[2 * dp], pa, bv[0], bv[1]);
        ptx::Mma16816<T>(o[2 * dp + 1], pa, bv[2], bv[3]);
      }
    }
  }

  // --- combine -----------------------------------------------------------------------------------

  // Each warp's (O, max, sum) into shared memory (the pipeline's, now idle) for the merge; row sums
  // were kept per lane and are reduced over the quad first.
  static __device__ __forceinline__ void StageWarp(const Out& o, const float (&m)[2], float (&l)[2],
                                                   float* s_o, float* s_m, float* s_l, int warp,
                                                   int lane) {
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      l[r2] += __shfl_xor_sync(0xffffffffu, l[r2], 1);
      l[r2] += __shfl_xor_sync(0xffffffffu, l[r2], 2);
    }
    ptx::CpAsyncWait<0>();
    __syncthreads();
    if (!Cfg::kProducer || warp < Cfg::kWarps) {  // the producer warp only takes the barriers
      float* w_o = s_o + warp * 16 * Cfg::kOStride;
#pragma unroll
      for (int dt = 0; dt < kD / 8; ++dt) {
        const int col = dt * 8 + 2 * (lane & 3);
        *reinterpret_cast<float2*>(w_o + (lane >> 2) * Cfg::kOStride + col) = make_float2(o[dt][0], o[dt][1]);
        *reinterpret_cast<float2*>(w_o + ((lane >> 2) + 8) * Cfg::kOStride + col) = make_float2(o[dt][2], o[dt][3]);
      }
      if ((lane & 3) == 0) {
        s_m[warp * 16 + (lane >> 2)] = m[0];
        s_m[warp * 16 + (lane >> 2) + 8] = m[1];
        s_l[warp * 16 + (lane >> 2)] = l[0];
        s_l[warp * 16 + (lane >> 2) + 8] = l[1];
      }
    }
    __syncthreads();
  }

  // Merges the kWarpsN warps that share rows in warp order and writes each (row, 4 columns) of the
  // CTA: with one split the normalised output (sinks applied); in a cluster the split's partial and
  // log2-sum-exp into s_part for ClusterCombine; otherwise into the workspace for the combine kernel.
  // A row's sum is 0 only when it saw no key (and no sink): its output is 0 and its log2-sum-exp
  // -inf. A NaN or +inf logit made the sum NaN (exp2(NaN), exp2(inf - inf)): the output and the
  // log2-sum-exp stay NaN, so the combine poisons the whole row (docs/attention.md, "NaN and Inf").
  static __device__ __forceinline__ void WriteSplit(const DecodeParams& p, const float* s_o,
                                                    const float* s_m, const float* s_l, float* s_part,
                                                    bool single, bool in_cluster, int b, int kvh,
                                                    int split, int row0, int tid) {
    const int64_t part_row0 = ((int64_t(b) * p.kv_heads + kvh) * p.splits + split) * p.rows;
    constexpr int kD4 = kD / 4;
    for (int idx = tid; idx < kBlockM * kD4; idx += kThreads) {
      const int r = idx / kD4, d = (idx % kD4) * 4;
      const int R = row0 + r;
      if (R >= p.rows) continue;
      const int w0 = (r >> 4) * kWarpsN, rr = r & 15;
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarpsN; ++w) mx = fmaxf(mx, s_m[(w0 + w) * 16 + rr]);
      const int h = kvh * p.group + R / p.q_len, i = R % p.q_len;
      // With one split the sink enters here; with several the combine adds it once.
      const float sink = SinkLog2(p.variant.sink, h, single);
      mx = fmaxf(mx, sink);
      const float m_use = mx == -INFINITY ? 0.f : mx;
      float sum = sink == -INFINITY ? 0.f : ptx::Exp2(sink - m_use);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < kWarpsN; ++w) {
        const float f = ptx::Exp2(s_m[(w0 + w) * 16 + rr] - m_use);
        sum += s_l[(w0 + w) * 16 + rr] * f;
        const float4 x = *reinterpret_cast<const float4*>(s_o + ((w0 + w) * 16 + rr) * Cfg::kOStride + d);
        acc.x += x.x * f; acc.y += x.y * f; acc.z += x.z * f; acc.w += x.w * f;
      }
      const float inv = sum == 0.f ? 0.f : 1.f / sum;  // NaN stays NaN
      acc.x *= inv; acc.y *= inv; acc.z *= inv; acc.w *= inv;
      if (single) {
        StoreVec4(static_cast<T*>(p.out) + b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_s + d, acc);
      } else if (in_cluster) {
        *reinterpret_cast<float4*>(s_part + r * kD + d) = acc;
        if (d == 0) s_part[kBlockM * kD + r] = sum == 0.f ? -INFINITY : mx + log2f(sum);
      } else {
        *reinterpret_cast<float4*>(p.part_o + (part_row0 + R) * kD + d) = acc;
        if (d == 0) p.part_lse[part_row0 + R] = sum == 0.f ? -INFINITY : mx + log2f(sum);
      }
    }
  }
};

// The body of DecodeSplitKernel (below), for every KV policy.
template <typename T, int kD, int kWarpsM, int kWarpsN, class Variant, class Kv>
__device__ __forceinline__ void DecodeSplitBody(const DecodeParams& p) {
  using Cfg = EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>;
  using Stages = SplitStages<T, kD, kWarpsM, kWarpsN, Kv>;
  constexpr int kBlockM = Cfg::kBlockM, kStride = Cfg::kStride, kStages = Cfg::kStages;
  constexpr int kChunk = Cfg::kChunk, kThreads = Cfg::kThreads, kTileN = Cfg::kTileN;
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);
  T* s_kv = reinterpret_cast<T*>(smem + Cfg::kQBytes);  // stage st: K tile 2 st, V tile 2 st + 1
  // Quantized: s_kv is the converted K / V tile pair, then the scales, then the ring of raw tiles.
  float* s_scale = reinterpret_cast<float*>(smem + Cfg::kQBytes + 2 * Cfg::kTileElems * sizeof(T));
  unsigned char* s_ring = smem + Cfg::kRingOffset;

  const int split = blockIdx.x;
  const int kvh = blockIdx.y / p.m_blocks;
  const int mb = blockIdx.y % p.m_blocks;
  const int b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int row0 = mb * kBlockM;  // first packed row of the CTA
  // With a producer warp (warp kWarps) the other warps only compute; without, every warp does both.
  const bool producer_warp = Cfg::kProducer && warp == Cfg::kWarps;
  [[maybe_unused]] const uint32_t bars = ptx::SmemAddr(smem + Cfg::kBarOffset);

  // The combine (if any) may be scheduled now; it waits for this grid to finish before reading.
  ptx::LaunchDependents();

  // load: Q, issued before kv_len is read (Q does not depend on it, and the two latencies overlap).
  // The cursor loads ask for kv_len first (a load the compiler keeps in place): its round trip then
  // also covers Q's address arithmetic. With a producer warp every warp asks for kv_len first, the
  // producer's lane 0 sets up the ring's barriers, and after the CTA barrier that publishes them the
  // producer copies Q.
  int kv_len_b;
  if constexpr (Cfg::kProducer) {
    kv_len_b = ptx::LoadGlobalS32(p.kv_len + b);
    if (producer_warp && lane == 0) Stages::InitBarriers(bars);
    __syncthreads();
    if (producer_warp) Stages::ProduceQ(s_q, p, b, kvh, row0, bars, lane);
  } else if constexpr (Kv::kCursor) {
    kv_len_b = ptx::LoadGlobalS32(p.kv_len + b);
    Stages::LoadQ(s_q, p, b, kvh, row0, tid);
  } else {
    Stages::LoadQ(s_q, p, b, kvh, row0, tid);
    kv_len_b = p.kv_len[b];
  }

  // The keys of this split the CTA's rows can see, from the variant's bounds.
  const int len = min(max(kv_len_b, 0), p.capacity);
  const Variant var(p.variant, len);
  const int pos0 = len - p.q_len + p.variant.pos_shift;  // position of query row 0
  const KeyBounds kb = var.Bounds(pos0, pos0 + p.q_len - 1);
  const int n_begin = max(kb.lo, split * p.split_rows);
  const int n_end = min(kb.hi, min((split + 1) * p.split_rows, p.capacity));
  const int t_begin = n_begin / kTileN;
  const int t_end = n_end > n_begin ? (n_end + kTileN - 1) / kTileN : t_begin;

  const T* k_base = static_cast<const T*>(p.k) + b * p.k_stride_b + kvh * p.k_stride_h;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_stride_b + kvh * p.v_stride_h;
  if constexpr (Cfg::kProducer) {
    if (producer_warp) Stages::ProduceKv(k_base, v_base, s_kv, bars, t_begin, t_end, n_begin, n_end, lane);
  }
  auto load_tile = [&](int t, int st) {
    if constexpr (Kv::kCursor) {
      Stages::LoadKvTileByCursor(t, st, k_base, v_base, s_kv, n_begin, n_end, tid);
    } else {
      Stages::LoadKvTile(t, st, p, b, kvh, k_base, v_base, s_kv, s_ring, n_begin, n_end, tid);
    }
  };

  // The two packed rows this thread holds in the mma accumulator layout: lane / 4 and lane / 4 + 8.
  QueryRow<> rows[2];
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const int R = min(row0 + wm * 16 + (lane >> 2) + 8 * r2, p.rows - 1);  // padding: any real row
    const int h = kvh * p.group + R / p.q_len, i = R % p.q_len;
    rows[r2].pos = pos0 + i;
    rows[r2].bias_off = b * p.variant.bias_stride_b + h * p.variant.bias_stride_h + i * p.variant.bias_stride_s;
  }

  float o[kD / 8][4];
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};
  uint32_t qa[Cfg::kQInRegs ? kD / 16 : 1][4];

  // load, prologue: Q and the first kStages - 1 tiles; Q lands in the first commit group. The
  // scales are plain stores, visible after the first barrier of the loop.
  if constexpr (!Cfg::kProducer) {
    if constexpr (Kv::kQuantized) Kv::template LoadScales<kD, kThreads>(s_scale, p.kv_scales, kvh, tid);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (t_begin + s < t_end) load_tile(t_begin + s, s);
      ptx::CpAsyncCommit();
    }
  }

  const uint32_t q_addr = ptx::SmemAddr(s_q + (wm * 16 + (lane & 15)) * kStride + (lane >> 4) * 8);
  // ldmatrix lane offsets: K tiles as the col-major B of Q K^T, V tiles transposed for P V.
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_col = ((lane >> 3) & 1) * 8;
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_col = (lane >> 4) * 8;
  uint32_t k_off[4], v_off[4];
  Stages::LaneOffsets(k_off, k_row, k_col);
  Stages::LaneOffsets(v_off, v_row, v_col);

  if (!producer_warp) {
    // With a producer warp: Q has landed (waited for even when the split has no tile, so that no
    // copy is in flight when the CTA ends); stage st of round ph is the next tile's.
    if constexpr (Cfg::kProducer) sm90::MbarWait(Stages::QFull(bars), 0u);
    [[maybe_unused]] int st = 0;
    [[maybe_unused]] uint32_t ph = 0;
    for (int t = t_begin; t < t_end; ++t) {
      const int it = t - t_begin;
      if constexpr (Cfg::kProducer) {
        // load: tile t is in (every producer lane's copies of it have landed).
        sm90::MbarWait(Stages::Full(bars, st), ph);
      } else {
        // load: tile t is in; every warp is done with the stage the next load overwrites.
        ptx::CpAsyncWait<kStages - 2>();
        __syncthreads();
        {
          const int tn = t + kStages - 1;
          if (tn < t_end) load_tile(tn, (it + kStages - 1) % kStages);
          ptx::CpAsyncCommit();
        }
        if constexpr (Kv::kQuantized) {
          // Tile t's raw bytes -> the T tile pair at s_kv (free: the barrier above saw every warp
          // finish tile t - 1); the second barrier publishes it.
          Kv::template ConvertTile<kD, kTileN, kThreads, Cfg::kTileStride, Cfg::kSwizzle>(
              s_kv, s_ring + (it % kStages) * Cfg::kStageBytes, s_scale, n_begin - t * kTileN,
              n_end - t * kTileN, tid);
          __syncthreads();
        }
      }
      if constexpr (Cfg::kQInRegs) {
        if (it == 0) {
#pragma unroll
          for (int kk = 0; kk < kD / 16; ++kk) ptx::LdMatrixX4(qa[kk], q_addr + kk * 32);
        }
      }
      const int stage = Kv::kQuantized ? 0 : Cfg::kProducer ? st : it % kStages;
      const T* s_k = s_kv + (2 * stage) * Cfg::kTileElems;
      const T* s_v = s_k + Cfg::kTileElems;
      const int n0 = t * kTileN;
      const bool full = n0 >= kb.full_lo && n0 + kTileN <= kb.full_hi;

#pragma unroll
      for (int ch = 0; ch < Cfg::kWarpN / kChunk; ++ch) {
        const int c0 = wn * Cfg::kWarpN + ch * kChunk;  // first tile column of the chunk
        float s[kChunk / 8][4];
        Stages::Qk(s, qa, q_addr, s_k, c0, k_off);  // QK
        // QK, masked: scores in the log2 domain, hidden keys -inf (the variant's rule; the bias is
        // read only for visible keys). A tile every row sees in full (most of them) takes the
        // branch without the per-key tests: the compiler does not hoist the block-uniform `full`
        // out of the unrolled loop (~10 instructions and two branches a score otherwise).
        if (full) {
#pragma unroll
          for (int nt = 0; nt < kChunk / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int j = n0 + c0 + nt * 8 + 2 * (lane & 3) + (e & 1);
              s[nt][e] = var.Score(s[nt][e], rows[e >> 1], j);
            }
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < kChunk / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int j = n0 + c0 + nt * 8 + 2 * (lane & 3) + (e & 1);
              const QueryRow<>& row = rows[e >> 1];
              s[nt][e] = var.Visible(row, j) ? var.Score(s[nt][e], row, j) : -INFINITY;
            }
          }
        }
        Stages::SoftmaxUpdate(s, m, l, o);  // softmax update
        Stages::Pv(s, o, s_v, c0, v_off);  // PV
      }
      if constexpr (Cfg::kProducer) {
        // load: this warp is done with the stage (its last ldmatrix has been issued by every lane).
        __syncwarp();
        if (lane == 0) sm90::MbarArrive(Stages::Empty(bars, st));
        if (++st == kStages) {
          st = 0;
          ph ^= 1u;
        }
      }
    }
  }

  // combine: the warps that share rows, then the CTA's output / partial, then the cluster. The
  // producer warp takes the CTA and cluster barriers only.
  float* s_o = reinterpret_cast<float*>(smem + Cfg::kQBytes);  // [warp][16][kOStride]
  float* s_m = s_o + Cfg::kWarps * 16 * Cfg::kOStride;        // [warp][16]
  float* s_l = s_m + Cfg::kWarps * 16;                         // [warp][16]
  Stages::StageWarp(o, m, l, s_o, s_m, s_l, warp, lane);

  const bool single = p.splits == 1;
  const bool in_cluster = Cfg::kClusterCombine && p.cluster > 1;
  float* s_part = reinterpret_cast<float*>(smem + Cfg::kQBytes + Cfg::kMergeBytes);
  if (!producer_warp) {
    Stages::WriteSplit(p, s_o, s_m, s_l, s_part, single, in_cluster, b, kvh, split, row0, tid);
  }
  if constexpr (Cfg::kClusterCombine) {
    constexpr int kLaunchThreads = Cfg::kLaunchThreads;
    if (in_cluster) ClusterCombine<T, kD, kBlockM, kThreads, kLaunchThreads>(p, s_part, b, kvh, row0, tid);
  }
}

template <typename T, int kD, int kWarpsM, int kWarpsN, class Variant, class Kv = DenseKv<T>>
__global__ void __launch_bounds__(EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>::kLaunchThreads,
                                  (EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>::kCtasPerSm))
    DecodeSplitKernel(const __grid_constant__ DecodeParams p) {
  if constexpr (Kv::kProducer && !kSm90Pass) {
    __trap();  // the producer warp's copies need sm_90; the launcher takes it only there
  } else {
    DecodeSplitBody<T, kD, kWarpsM, kWarpsN, Variant, Kv>(p);
  }
}

}  // namespace joa::decode
