// The split-KV decode engine on an int8 / int4 cache dequantised in registers (QuantRegKv,
// kv_format.cuh): DecodeSplitKernel's stages and schedule, except that
//   load     the ring holds the raw K / V rows (padded pitches, no converted T tile: no second
//            shared-memory pass), whole tiles copied from cursors (QuantRegKv::TileStream: rows
//            one after another), an int4 cache's by the warps that read them (no CTA barrier a
//            tile); Q is permuted into the channel order of the
//            K fragments (and scaled by a per-channel K scale) and staged in f16 under a
//            power-of-two scale per row, once per CTA;
//   QK       each lane reads whole packed words of its K row and builds the B fragments in
//            registers (exact integers as f16, QuantRegKv::MmaT, for f16 and bf16 caches: f16's
//            conversions are the shorter ones); a per-tensor K scale and the row's 1 / scale
//            multiply the logits;
//   PV       P rounded to f16; each lane reads words of V rows 2t, 2t + 1, 2t + 8, 2t + 9 and
//            builds the B fragments likewise; O's columns come out permuted (QuantRegKv::VChan);
//   combine  the V scales multiply the f32 O columns and the permutation is undone as each warp
//            stages its O for the merge; the merge and the writes are DecodeSplitKernel's.
// Selected by LaunchOptions::quant_regs: the plan's choice by the call's size (plan.h QuantPath,
// kQuantRegsMinRows) unless the caller forces one; Launch takes it only for contiguous rows. Its
// key-rows form (kKeyRows, QRegKeyRowStages; LaunchOptions::key_rows, the default for blocks of at
// most 8 query rows) runs QK and PV transposed (key_rows.cuh): the register kernel is bound by its
// instructions at int4 (docs/kernels.md, "Quantised caches"), and half the MMAs and score work pay.
#pragma once

#include <type_traits>

#include "kernels/decode/engine.cuh"
#include "kernels/decode/key_rows.cuh"

namespace joa::decode {

template <typename T, int kD, int kWarpsM, int kWarpsN, class Kv>
struct QRegStages {
  using Cfg = EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>;
  static_assert(Kv::kInRegs, "a policy that dequantises in registers");
  static constexpr int kBlockM = Cfg::kBlockM, kStride = Cfg::kStride, kThreads = Cfg::kThreads;
  static constexpr int kChunk = Cfg::kChunk, kTileN = Cfg::kTileN;
  static constexpr int kKPitch = Cfg::kKPitch, kVPitch = Cfg::kVPitch;
  static constexpr int kPairs = kD / 32;         // k-step pairs of whole 32-channel groups
  static constexpr bool kTail = kD % 32 != 0;    // one more 16-channel k step (D 80)
  static constexpr int kGroups = kPairs + (kTail ? 1 : 0);
  using Scores = float[kChunk / 8][4];
  using Out = float[kD / 8][4];

  using MmaT = typename Kv::MmaT;
  static_assert(Cfg::kStride >= kD + 2, "Q rows are padded: a row's scale slot lives there");

  // The first word of Q row r's padding: the bits of the row's largest |value| while PrepareQ runs.
  static __device__ __forceinline__ unsigned* RowSlot(T* s_q, int r) {
    return reinterpret_cast<unsigned*>(s_q + r * kStride + kD);
  }
  // Before anything else touches Q: the rows' slots to 0 (ordered before PrepareQ's atomics by the
  // barrier ahead of the first tile).
  static __device__ __forceinline__ void ClearRowSlots(T* s_q, int tid) {
    if (tid < kBlockM) *RowSlot(s_q, tid) = 0u;
  }

  // The power-of-two exponent e of a row whose largest |value| has the bits mx: that value times
  // 2^e in [2^14, 2^15), within f16's range whatever T holds (bf16's range is f32's); 0 for a zero
  // row and for inf / NaN (they propagate as they are).
  static __device__ __forceinline__ int RowExp(unsigned mx) {
    const int ex = int(mx >> 23);
    if (mx == 0u || ex == 255) return 0;
    return min(max(14 - (ex - 127), -126), 126);
  }
  static __device__ __forceinline__ float Pow2(int e) { return __uint_as_float(unsigned(127 + e) << 23); }

  // 1 / the row scale of local Q row r, for its logits (after PrepareQ's last barrier).
  static __device__ __forceinline__ float RowUnscale(T* s_q, int r) { return Pow2(-RowExp(*RowSlot(s_q, r))); }

  // Q rows in shared memory (T) -> Q'[r][16 kk + k] = f16(Q[r][KChan(kk, k)] * s * 2^e_r) in place:
  // s the K scale of that channel when K is scaled per channel, 2^e_r the row's scale (RowExp).
  // A thread owns whole 32-channel groups (the map stays inside one). Two passes: the rows' maxima
  // (atomicMax on the bits of non-negative floats: order-free, so the same bits every run), a
  // barrier, the conversion.
  static __device__ __forceinline__ void PrepareQ(T* s_q, const float* s_kscale, bool k_per_channel,
                                                  int tid) {
    for (int c = tid; c < kBlockM * kGroups; c += kThreads) {
      const int r = c / kGroups, grp = c % kGroups;
      const T* row = s_q + r * kStride + 32 * grp;
      const float* ks = s_kscale + 32 * grp;
      const int w = !kTail || grp < kPairs ? 32 : 16;
      float mx = 0.f;
      bool nan = false;  // fmaxf drops NaN; a NaN row stays unscaled (RowExp of NaN's bits)
      for (int j = 0; j < w; ++j) {
        const float v = fabsf(float(row[j]) * (k_per_channel ? ks[j] : 1.f));
        mx = fmaxf(mx, v);
        nan |= v != v;
      }
      atomicMax(RowSlot(s_q, r), nan ? 0x7FC00000u : __float_as_uint(mx));
    }
    __syncthreads();
    for (int c = tid; c < kBlockM * kGroups; c += kThreads) {
      const int r = c / kGroups, grp = c % kGroups;
      T* row = s_q + r * kStride + 32 * grp;
      const float f = Pow2(RowExp(*RowSlot(s_q, r)));
      if (!kTail || grp < kPairs) {
        PermuteGroup<32>(row, s_kscale + 32 * grp, k_per_channel, f);
      } else {
        PermuteGroup<16>(row, s_kscale + 32 * grp, k_per_channel, f);
      }
    }
  }

  template <int kW>
  static __device__ __forceinline__ void PermuteGroup(T* row, const float* ks, bool per_channel, float f) {
    alignas(16) T x[kW];
#pragma unroll
    for (int i = 0; i < kW / 8; ++i) *reinterpret_cast<uint4*>(x + 8 * i) = reinterpret_cast<const uint4*>(row)[i];
    alignas(16) MmaT y[kW];
#pragma unroll
    for (int j = 0; j < kW; ++j) {
      const int kk_local = j / 16, k = j % 16;
      const int t = (k >> 1) & 3, e = k & 1, h = k >> 3;
      // The channel relative to the group: the tail's map (kW 16) or the paired one (a group's
      // k steps are 2 grp and 2 grp + 1: KChan of steps 0 / 1 is the offset inside it).
      const int ch = kW == 16 ? 4 * t + h + 2 * e : Kv::KChan(kD, kk_local, t, h, e);
      y[j] = __float2half_rn(float(x[ch]) * (per_channel ? ks[ch] : 1.f) * f);
    }
#pragma unroll
    for (int i = 0; i < kW / 8; ++i) reinterpret_cast<uint4*>(row)[i] = *reinterpret_cast<const uint4*>(y + 8 * i);
  }

  // s = Q' K^T for the kChunk tile columns from c0, the K B fragments built from the raw rows.
  template <int kQRegs>
  static __device__ __forceinline__ void Qk(Scores& s, const uint32_t (&qa)[kQRegs][4], uint32_t q_addr,
                                            const unsigned char* s_kr, int c0, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    constexpr int kUnroll = Cfg::kQInRegs ? (kPairs > 0 ? kPairs : 1) : 2;
#pragma unroll kUnroll
    for (int kp = 0; kp < kPairs; ++kp) {
      uint32_t a0[4], a1[4];
      LoadA(a0, qa, q_addr, 2 * kp);
      LoadA(a1, qa, q_addr, 2 * kp + 1);
#pragma unroll
      for (int nt = 0; nt < kChunk / 8; ++nt) {
        uint32_t b[4];
        Kv::template KPair<kD>(b, s_kr + (c0 + nt * 8 + g) * kKPitch, kp, t);
        ptx::Mma16816<MmaT>(s[nt], a0, b[0], b[1]);
        ptx::Mma16816<MmaT>(s[nt], a1, b[2], b[3]);
      }
    }
    if constexpr (kTail) {
      constexpr int kk = kD / 16 - 1;
      uint32_t a[4];
      LoadA(a, qa, q_addr, kk);
#pragma unroll
      for (int nt = 0; nt < kChunk / 8; ++nt) {
        uint32_t b[2];
        Kv::KTail(b, s_kr + (c0 + nt * 8 + g) * kKPitch, kk, t);
        ptx::Mma16816<MmaT>(s[nt], a, b[0], b[1]);
      }
    }
  }

  template <int kQRegs>
  static __device__ __forceinline__ void LoadA(uint32_t (&a)[4], const uint32_t (&qa)[kQRegs][4],
                                               uint32_t q_addr, int kk) {
    if constexpr (Cfg::kQInRegs) {
      a[0] = qa[kk][0]; a[1] = qa[kk][1]; a[2] = qa[kk][2]; a[3] = qa[kk][3];
    } else {
      ptx::LdMatrixX4(a, q_addr + kk * 32);
    }
  }

  // O += P V over the chunk, the V B fragments built from the raw rows (O columns permuted).
  static __device__ __forceinline__ void Pv(const Scores& s, Out& o, const unsigned char* s_vr, int c0,
                                            int g, int t) {
#pragma unroll
    for (int kc = 0; kc < kChunk / 16; ++kc) {
      const uint32_t pa[4] = {ptx::Pack2<MmaT>(s[2 * kc][0], s[2 * kc][1]),
                              ptx::Pack2<MmaT>(s[2 * kc][2], s[2 * kc][3]),
                              ptx::Pack2<MmaT>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                              ptx::Pack2<MmaT>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
      const unsigned char* r0 = s_vr + (c0 + kc * 16 + 2 * t) * kVPitch;
      const unsigned char* const rows[4] = {r0, r0 + kVPitch, r0 + 8 * kVPitch, r0 + 9 * kVPitch};
      PvSegments<0>(o, pa, rows, g);
    }
  }

  template <int kSeg>
  static __device__ __forceinline__ void PvSegments(Out& o, const uint32_t (&pa)[4],
                                                    const unsigned char* const (&rows)[4], int g) {
    if constexpr (kSeg < Kv::NumSegs(kD)) {
      constexpr int kStart = Kv::SegStart(kD, kSeg);
      Kv::template PvSegment<kD, kStart, Kv::SegW(kD, kStart), kD / 8>(o, pa, rows, g);
      PvSegments<kSeg + 1>(o, pa, rows, g);
    }
  }

  // StageWarp of engine.cuh, with O's columns scaled by the V scales and un-permuted (VChan). The
  // scales are read between two barriers: the first makes them visible where the loop ran no tile
  // (an empty split: O is 0, and 0 times an unwritten NaN would poison the row), the second keeps
  // them from being overwritten by the merge area, which overlaps them.
  static __device__ __forceinline__ void StageWarp(Out& o, const float (&m)[2], float (&l)[2],
                                                   const float* s_vscale, float* s_o, float* s_m,
                                                   float* s_l, int warp, int lane) {
    __syncthreads();
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      l[r2] += __shfl_xor_sync(0xffffffffu, l[r2], 1);
      l[r2] += __shfl_xor_sync(0xffffffffu, l[r2], 2);
    }
    const int t = lane & 3;
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float vs = s_vscale[VChanOf(dt, 2 * t + e)];
        o[dt][e] *= vs;
        o[dt][2 + e] *= vs;
      }
    }
    ptx::CpAsyncWait<0>();
    __syncthreads();
    float* w_o = s_o + warp * 16 * Cfg::kOStride;
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = VChanOf(dt, 2 * t + e);
        w_o[(lane >> 2) * Cfg::kOStride + col] = o[dt][e];
        w_o[((lane >> 2) + 8) * Cfg::kOStride + col] = o[dt][2 + e];
      }
    }
    if ((lane & 3) == 0) {
      s_m[warp * 16 + (lane >> 2)] = m[0];
      s_m[warp * 16 + (lane >> 2) + 8] = m[1];
      s_l[warp * 16 + (lane >> 2)] = l[0];
      s_l[warp * 16 + (lane >> 2) + 8] = l[1];
    }
    __syncthreads();
  }

  // VChan with a constant n8 tile (unrolled) and the lane's column.
  static __device__ __forceinline__ int VChanOf(int dt, int col) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < Kv::NumSegs(kD); ++i) {
      const int st = Kv::SegStart(kD, i), w = Kv::SegW(kD, st);
      if (8 * dt >= st && 8 * dt < st + w) s = st + (w / 8) * col + (dt - st / 8);
    }
    return s;
  }
};

// The register kernel's key-rows form (key_rows.cuh): QK's A operand is the K fragments of key rows
// g and g + 8 (KPair's B fragments of those rows as {lo[0], hi[0], lo[1], hi[1]}), B Q' (permuted
// and row-scaled by PrepareQ); PV's A the V fragments PvSegment builds for two O n8 tiles
// (QuantRegKv::PvSegmentKeyRows). The same unpack as QRegStages'.
template <typename T, int kD, int kWarpsM, int kWarpsN, class Kv>
struct QRegKeyRowStages {
  using Cfg = EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>;
  using QStages = QRegStages<T, kD, kWarpsM, kWarpsN, Kv>;
  static constexpr int kChunk = Cfg::kChunk;
  static constexpr int kKPitch = Cfg::kKPitch, kVPitch = Cfg::kVPitch;
  static_assert(kChunk % 16 == 0, "a chunk is whole m16 key tiles");
  static constexpr int kKeyTiles = kChunk / 16;
  static constexpr int kSteps = kD / 16;  // k16 steps over the channels
  static constexpr int kPairs = QStages::kPairs;
  static constexpr bool kTail = QStages::kTail;
  // S^T of a chunk: element e of key tile kt is (key 16 kt + g + 8 (e >> 1), query row 2t + (e & 1)).
  using Scores = float[kKeyTiles][4];
  // O^T: element e of m16 tile mt is (channel VChan(2 mt + (e >> 1), g), query row 2t + (e & 1)).
  using Out = float[kD / 16][4];
  using MmaT = typename Kv::MmaT;

  // s = K Q'^T for the kChunk tile rows from c0. A key tile's k steps go to two accumulators (even
  // and odd steps, added at the end): two dependent MMA chains of kSteps / 2, not one of kSteps.
  static __device__ __forceinline__ void Qk(Scores& s, const uint32_t (&qb)[kSteps][2], const unsigned char* s_kr,
                                            int c0, int g, int t) {
    float s2[kKeyTiles][4];
#pragma unroll
    for (int kt = 0; kt < kKeyTiles; ++kt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[kt][e] = s2[kt][e] = 0.f;
    }
#pragma unroll
    for (int kp = 0; kp < kPairs; ++kp) {
#pragma unroll
      for (int kt = 0; kt < kKeyTiles; ++kt) {
        uint32_t lo[4], hi[4];  // rows g and g + 8: k steps 2 kp ([0], [1]) and 2 kp + 1 ([2], [3])
        Kv::template KPair<kD>(lo, s_kr + (c0 + 16 * kt + g) * kKPitch, kp, t);
        Kv::template KPair<kD>(hi, s_kr + (c0 + 16 * kt + 8 + g) * kKPitch, kp, t);
        const uint32_t a0[4] = {lo[0], hi[0], lo[1], hi[1]};
        const uint32_t a1[4] = {lo[2], hi[2], lo[3], hi[3]};
        ptx::Mma16816<MmaT>(s[kt], a0, qb[2 * kp][0], qb[2 * kp][1]);
        ptx::Mma16816<MmaT>(s2[kt], a1, qb[2 * kp + 1][0], qb[2 * kp + 1][1]);
      }
    }
    if constexpr (kTail) {
      constexpr int kk = kSteps - 1;
#pragma unroll
      for (int kt = 0; kt < kKeyTiles; ++kt) {
        uint32_t lo[2], hi[2];
        Kv::KTail(lo, s_kr + (c0 + 16 * kt + g) * kKPitch, kk, t);
        Kv::KTail(hi, s_kr + (c0 + 16 * kt + 8 + g) * kKPitch, kk, t);
        const uint32_t a[4] = {lo[0], hi[0], lo[1], hi[1]};
        ptx::Mma16816<MmaT>(s[kt], a, qb[kk][0], qb[kk][1]);
      }
    }
#pragma unroll
    for (int kt = 0; kt < kKeyTiles; ++kt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[kt][e] += s2[kt][e];
    }
  }

  // O^T += V^T P^T over the chunk (O's channels permuted as the register kernel's).
  static __device__ __forceinline__ void Pv(const Scores& s, Out& o, const unsigned char* s_vr, int c0, int g,
                                            int t) {
#pragma unroll
    for (int kt = 0; kt < kKeyTiles; ++kt) {
      uint32_t pb[2];
      KeyRows::Pt<MmaT>(pb, s[kt]);
      const unsigned char* r0 = s_vr + (c0 + kt * 16 + 2 * t) * kVPitch;
      const unsigned char* const rows[4] = {r0, r0 + kVPitch, r0 + 8 * kVPitch, r0 + 9 * kVPitch};
      PvSegments<0>(o, pb, rows, g);
    }
  }

  template <int kSeg>
  static __device__ __forceinline__ void PvSegments(Out& o, const uint32_t (&pb)[2],
                                                    const unsigned char* const (&rows)[4], int g) {
    if constexpr (kSeg < Kv::NumSegs(kD)) {
      constexpr int kStart = Kv::SegStart(kD, kSeg);
      Kv::template PvSegmentKeyRows<kD, kStart, Kv::SegW(kD, kStart), kD / 16>(o, pb, rows, g);
      PvSegments<kSeg + 1>(o, pb, rows, g);
    }
  }

  // QRegStages::StageWarp for O^T: the lane's sums reduced over its column's 8 lanes, O's channels
  // scaled by the V scales and un-permuted, query rows 0-7 of the warp's merge rows written (the
  // merge reads no row past the block's, kKeyRowsMaxRows at most). The same two barriers.
  static __device__ __forceinline__ void StageWarp(Out& o, const float (&m)[2], float (&l)[2],
                                                   const float* s_vscale, float* s_o, float* s_m,
                                                   float* s_l, int warp, int lane) {
    __syncthreads();
    KeyRows::ReduceSums(l);
    const int g = lane >> 2, t = lane & 3;
    int ch[kD / 16][2];
#pragma unroll
    for (int mt = 0; mt < kD / 16; ++mt) {
      ch[mt][0] = QStages::VChanOf(2 * mt, g);
      ch[mt][1] = QStages::VChanOf(2 * mt + 1, g);
      const float vs0 = s_vscale[ch[mt][0]], vs1 = s_vscale[ch[mt][1]];
      o[mt][0] *= vs0;
      o[mt][1] *= vs0;
      o[mt][2] *= vs1;
      o[mt][3] *= vs1;
    }
    ptx::CpAsyncWait<0>();
    __syncthreads();
    float* w_o = s_o + warp * 16 * Cfg::kOStride;
#pragma unroll
    for (int mt = 0; mt < kD / 16; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) w_o[(2 * t + (e & 1)) * Cfg::kOStride + ch[mt][e >> 1]] = o[mt][e];
    }
    KeyRows::StageStats(m, l, s_m, s_l, warp, lane);
    __syncthreads();
  }
};

// kKeyRows: keys as the MMA rows (QRegKeyRowStages; blocks of at most kKeyRowsMaxRows query rows in
// one warp row), else query rows (QRegStages).
template <typename T, int kD, int kWarpsM, int kWarpsN, class Variant, class Kv, bool kKeyRows = false>
__global__ void __launch_bounds__(32 * kWarpsM * kWarpsN,
                                  (EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>::kCtasPerSm))
    DecodeSplitKernelQRegs(const __grid_constant__ DecodeParams p) {
  using Cfg = EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>;
  using Stages = SplitStages<T, kD, kWarpsM, kWarpsN, Kv>;
  using QStages = QRegStages<T, kD, kWarpsM, kWarpsN, Kv>;
  using KStages = QRegKeyRowStages<T, kD, kWarpsM, kWarpsN, Kv>;
  static_assert(!kKeyRows || kWarpsM == 1, "key rows: one warp row (the block's query rows are the MMAs' 8 columns)");
  constexpr int kBlockM = Cfg::kBlockM, kStride = Cfg::kStride, kStages = Cfg::kStages;
  constexpr int kChunk = Cfg::kChunk, kThreads = Cfg::kThreads, kTileN = Cfg::kTileN;
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);
  // The K / V scales, then the ring of raw tiles (stage: K rows, then V rows).
  float* s_scale = reinterpret_cast<float*>(smem + Cfg::kQBytes);
  unsigned char* s_ring = smem + Cfg::kRingOffset;

  const int split = blockIdx.x;
  const int kvh = blockIdx.y / p.m_blocks;
  const int mb = blockIdx.y % p.m_blocks;
  const int b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int row0 = mb * kBlockM;
  const int g = lane >> 2, t4 = lane & 3;

  ptx::LaunchDependents();
  QStages::ClearRowSlots(s_q, tid);
  Stages::LoadQ(s_q, p, b, kvh, row0, tid);

  const int len = min(max(p.kv_len[b], 0), p.capacity);
  const Variant var(p.variant, len);
  const int pos0 = len - p.q_len + p.variant.pos_shift;
  const KeyBounds kb = var.Bounds(pos0, pos0 + p.q_len - 1);
  const int n_begin = max(kb.lo, split * p.split_rows);
  const int n_end = min(kb.hi, min((split + 1) * p.split_rows, p.capacity));
  const int t_begin = n_begin / kTileN;
  const int t_end = n_end > n_begin ? (n_end + kTileN - 1) / kTileN : t_begin;

  // Rows one after another (Launch takes this kernel only then): tiles stream from cursors, in
  // order, into the ring's stages in turn. An int4 cache with one warp row (1 x N layouts): a warp
  // reads only its kWarpN rows of a tile, so it copies them itself and the ring's hand-off is the
  // warp's own (its copies' wait and a warp barrier): no CTA barrier a tile, the warps decoupled.
  // That pays where the kernel is bound by its instructions (int4: B=8 128k 400 -> 380 µs) and
  // costs where it is bound by HBM (int8: B=8 16k 80 -> 87, B=1 128k 85 -> 90; against 5b0dc61's,
  // bench/results/archive/2026-12-04-4b0cb85-decode-qregs-*.json). Otherwise the CTA copies the tile.
  constexpr bool kWarpCopies = kWarpsM == 1 && Kv::kBits == 4;
  constexpr int kCopyRows = kWarpCopies ? Cfg::kWarpN : kTileN;
  const int copy_row0 = kWarpCopies ? wn * Cfg::kWarpN : 0, copy_tid = kWarpCopies ? lane : tid;
  constexpr int64_t kRowBytes = Kv::template RowBytes<kD>();
  const auto* k0 = static_cast<const unsigned char*>(p.k) + b * p.k_stride_b + kvh * p.k_stride_h;
  const auto* v0 = static_cast<const unsigned char*>(p.v) + b * p.v_stride_b + kvh * p.v_stride_h;
  using Stream = typename Kv::template TileStream<kD, kCopyRows, kTileN, kWarpCopies ? 32 : kThreads,
                                                  Cfg::kKPitch, Cfg::kVPitch>;
  Stream kv_stream(k0 + copy_row0 * kRowBytes, v0 + copy_row0 * kRowBytes, t_begin, copy_tid);
  int st_load = 0;  // the stage the next tile lands in
  auto load_tile = [&](int t) {
    unsigned char* stage = s_ring + st_load * Cfg::kStageBytes;
    const int row0 = t * kTileN + copy_row0;
    kv_stream.Load(stage + copy_row0 * Cfg::kKPitch, stage + kTileN * Cfg::kKPitch + copy_row0 * Cfg::kVPitch,
                   n_begin - row0, n_end - row0, copy_tid);
    st_load = st_load + 1 == kStages ? 0 : st_load + 1;
  };

  // The lane's two packed rows: lane / 4 and lane / 4 + 8 (key rows: its query columns 2t, 2t + 1).
  auto local_row = [&](int r2) { return kKeyRows ? 2 * t4 + r2 : wm * 16 + (lane >> 2) + 8 * r2; };
  QueryRow<> rows[2];
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const int R = min(row0 + local_row(r2), p.rows - 1);
    const int h = kvh * p.group + R / p.q_len, i = R % p.q_len;
    rows[r2].pos = pos0 + i;
    rows[r2].bias_off = b * p.variant.bias_stride_b + h * p.variant.bias_stride_h + i * p.variant.bias_stride_s;
  }

  // O (key rows: O^T, half the accumulators) and Q's fragments (key rows: B fragments).
  constexpr int kOTiles = kKeyRows ? kD / 16 : kD / 8;
  float o[kOTiles][4];
#pragma unroll
  for (int dt = 0; dt < kOTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};
  uint32_t qa[Cfg::kQInRegs && !kKeyRows ? kD / 16 : 1][4];
  [[maybe_unused]] uint32_t qb[kKeyRows ? kD / 16 : 1][2];
  // A per-tensor K scale times the row's 1 / scale (times the variant's scale where its Score is
  // that multiply: one multiply a score), and the logit of a raw score.
  float k_mul[2] = {1.f, 1.f};
  auto logit = [&](float x, int r2, int j) {
    if constexpr (Variant::kScoreIsScale) {
      return x * k_mul[r2];
    } else {
      return var.Score(x * k_mul[r2], rows[r2], j);
    }
  };

  Kv::template LoadScales<kD, kThreads>(s_scale, p.kv_scales, kvh, tid);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (t_begin + s < t_end) load_tile(t_begin + s);
    ptx::CpAsyncCommit();
  }

  const uint32_t q_addr = ptx::SmemAddr(s_q + (wm * 16 + (lane & 15)) * kStride + (lane >> 4) * 8);

  int st_use = 0;  // the stage tile t sits in
  for (int t = t_begin; t < t_end; ++t) {
    const int it = t - t_begin;
    ptx::CpAsyncWait<kStages - 2>();
    // The first tile's group also holds Q and the scales, which every warp reads: a CTA barrier.
    if (!kWarpCopies || it == 0) {
      __syncthreads();
    } else {
      __syncwarp();
    }
    {
      const int tn = t + kStages - 1;
      if (tn < t_end) load_tile(tn);
      ptx::CpAsyncCommit();
    }
    if (it == 0) {
      // Q (first commit group) and the scales are in: Q into the K fragments' channel order, once.
      QStages::PrepareQ(s_q, s_scale, p.kv_scales.k_per_channel, tid);
      __syncthreads();
      const float k_tensor = p.kv_scales.k_per_channel ? 1.f : s_scale[0];
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        k_mul[r2] = k_tensor * QStages::RowUnscale(s_q, local_row(r2));
        if constexpr (Variant::kScoreIsScale) k_mul[r2] *= var.ScoreScale();
      }
      if constexpr (kKeyRows) {
        KeyRows::LoadQ<kD, kStride>(qb, s_q, lane);
      } else if constexpr (Cfg::kQInRegs) {
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) ptx::LdMatrixX4(qa[kk], q_addr + kk * 32);
      }
    }
    const unsigned char* s_kr = s_ring + st_use * Cfg::kStageBytes;
    st_use = st_use + 1 == kStages ? 0 : st_use + 1;
    const unsigned char* s_vr = s_kr + kTileN * Cfg::kKPitch;
    const int n0 = t * kTileN;
    const bool full = n0 >= kb.full_lo && n0 + kTileN <= kb.full_hi;

#pragma unroll
    for (int ch = 0; ch < Cfg::kWarpN / kChunk; ++ch) {
      const int c0 = wn * Cfg::kWarpN + ch * kChunk;
      // Score element e of n8 (key rows: m16) tile i: its key and its row of `rows`.
      auto key = [&](int i, int e) {
        return kKeyRows ? n0 + c0 + 16 * i + g + 8 * (e >> 1) : n0 + c0 + 8 * i + 2 * t4 + (e & 1);
      };
      auto row_of = [](int e) { return kKeyRows ? e & 1 : e >> 1; };
      using Scores = std::conditional_t<kKeyRows, typename KStages::Scores, typename QStages::Scores>;
      Scores s;
      if constexpr (kKeyRows) {
        KStages::Qk(s, qb, s_kr, c0, g, t4);
      } else {
        QStages::Qk(s, qa, q_addr, s_kr, c0, g, t4);
      }
      // As in DecodeSplitKernel: whole visible tiles without the per-key tests (a variant's Score
      // runs on visible keys only: a bias is never read out of its bounds).
      constexpr int kScoreTiles = sizeof(Scores) / sizeof(s[0]);
      if (full) {
#pragma unroll
        for (int i = 0; i < kScoreTiles; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[i][e] = logit(s[i][e], row_of(e), key(i, e));
        }
      } else {
#pragma unroll
        for (int i = 0; i < kScoreTiles; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[i][e] = var.Visible(rows[row_of(e)], key(i, e)) ? logit(s[i][e], row_of(e), key(i, e)) : -INFINITY;
          }
        }
      }
      if constexpr (kKeyRows) {
        KeyRows::Softmax(s, m, l, o);
        KStages::Pv(s, o, s_vr, c0, g, t4);
      } else {
        Stages::SoftmaxUpdate(s, m, l, o);
        QStages::Pv(s, o, s_vr, c0, g, t4);
      }
    }
  }

  float* s_o = reinterpret_cast<float*>(smem + Cfg::kQBytes);
  float* s_m = s_o + Cfg::kWarps * 16 * Cfg::kOStride;
  float* s_l = s_m + Cfg::kWarps * 16;
  if constexpr (kKeyRows) {
    KStages::StageWarp(o, m, l, s_scale + kD, s_o, s_m, s_l, warp, lane);
  } else {
    QStages::StageWarp(o, m, l, s_scale + kD, s_o, s_m, s_l, warp, lane);
  }

  const bool single = p.splits == 1;
  const bool in_cluster = Cfg::kClusterCombine && p.cluster > 1;
  float* s_part = reinterpret_cast<float*>(smem + Cfg::kQBytes + Cfg::kMergeBytes);
  Stages::WriteSplit(p, s_o, s_m, s_l, s_part, single, in_cluster, b, kvh, split, row0, tid);
  if constexpr (Cfg::kClusterCombine) {
    if (in_cluster) ClusterCombine<T, kD, kBlockM, kThreads>(p, s_part, b, kvh, row0, tid);
  }
}

}  // namespace joa::decode
