// The register kernel of engine_qregs.cuh (an int8 / int4 cache dequantised in registers) with its
// MMAs transposed: keys are the rows of every MMA and the query rows its columns,
//   QK   S^T = K Q'^T    A: the K fragments of key rows g and g + 8 (QuantRegKv::KPair's B
//                        fragments of those two rows), B: Q' from shared memory, kept in registers;
//   PV   O^T += V^T P^T  A: the V fragments PvSegment builds for two O n8 tiles
//                        (QuantRegKv::PvSegmentKeyRows), B: P^T, the score tile's f16 halves
//                        transposed in registers (movmatrix).
// Why: a decode block holds few query rows (G * S: 4 at 32/8 heads). As the rows of an m16n8k16
// MMA they are 1/4 of it; as its 8 columns, 1/2. So half the MMAs, half the score elements a lane
// (scaling, masks, exp2), half the O accumulators (and their rescale), for the same unpack: the
// register kernel at int4 is bound by its instructions (docs/kernels.md, "Quantised caches").
// Everything else is DecodeSplitKernelQRegs's: the ring and its copies, Q's permutation and row
// scale (QRegStages::PrepareQ), the merge and the writes. Blocks of at most kKeyRowsMaxRows query
// rows in one warp row (1 x N layouts): Launch takes it there (LaunchOptions::key_rows).
#pragma once

#include "kernels/decode/engine_qregs.cuh"

namespace joa::decode {

// Query rows a key-rows block takes: the MMA's 8 columns.
inline constexpr int kKeyRowsMaxRows = 8;

template <typename T, int kD, int kWarpsM, int kWarpsN, class Kv>
struct KeyRowStages {
  using Cfg = EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>;
  using QStages = QRegStages<T, kD, kWarpsM, kWarpsN, Kv>;
  static_assert(kWarpsM == 1, "one warp row: the block's query rows are the MMAs' 8 columns");
  static constexpr int kStride = Cfg::kStride, kChunk = Cfg::kChunk;
  static constexpr int kKPitch = Cfg::kKPitch, kVPitch = Cfg::kVPitch;
  static_assert(kChunk % 16 == 0, "a chunk is whole m16 key tiles");
  static constexpr int kKeyTiles = kChunk / 16;
  static constexpr int kSteps = kD / 16;  // k16 steps over the channels
  static constexpr int kPairs = kD / 32;
  static constexpr bool kTail = kD % 32 != 0;
  // S^T of a chunk: element e of key tile kt is (key 16 kt + g + 8 (e >> 1), query row 2t + (e & 1)).
  using Scores = float[kKeyTiles][4];
  // O^T: element e of m16 tile mt is (channel VChan(2 mt + (e >> 1), g), query row 2t + (e & 1)).
  using Out = float[kD / 16][4];
  using MmaT = typename Kv::MmaT;

  // Q' rows 0-7 (after PrepareQ) as the B fragments of every k16 step: qb[kk] = channels
  // 16 kk + 2t, + 1 and 16 kk + 8 + 2t, + 1 of query row g.
  static __device__ __forceinline__ void LoadQ(uint32_t (&qb)[kSteps][2], const T* s_q, int lane) {
    const uint32_t addr = ptx::SmemAddr(s_q + (lane & 7) * kStride + (lane >> 3) * 8);
#pragma unroll
    for (int kp = 0; kp < kPairs; ++kp) {
      uint32_t r[4];
      ptx::LdMatrixX4(r, addr + kp * 64);
      qb[2 * kp][0] = r[0];
      qb[2 * kp][1] = r[1];
      qb[2 * kp + 1][0] = r[2];
      qb[2 * kp + 1][1] = r[3];
    }
    if constexpr (kTail) ptx::LdMatrixX2(qb[kSteps - 1], addr + (kSteps - 1) * 32);
  }

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

  // The online softmax over a chunk, per query column (the 8 lanes of a column g share it): the
  // max over the keys of every lane group, s -> exp2(s - m), the lane's running sum l, the rescale
  // of O. One branch for both columns: a column whose max stayed has corr exactly 1.
  static __device__ __forceinline__ void SoftmaxUpdate(Scores& s, float (&m)[2], float (&l)[2], Out& o) {
    float corr[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float mx = fmaxf(s[0][c], s[0][2 + c]);
#pragma unroll
      for (int kt = 1; kt < kKeyTiles; ++kt) mx = fmaxf(mx, fmaxf(s[kt][c], s[kt][2 + c]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m[c], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no visible key yet: exp2 stays 0
      corr[c] = ptx::Exp2(m[c] - m_use);
      m[c] = m_new;
#pragma unroll
      for (int kt = 0; kt < kKeyTiles; ++kt) {
        s[kt][c] = ptx::Exp2(s[kt][c] - m_use);
        s[kt][2 + c] = ptx::Exp2(s[kt][2 + c] - m_use);
      }
      float sum = s[0][c] + s[0][2 + c];
#pragma unroll
      for (int kt = 1; kt < kKeyTiles; ++kt) sum += s[kt][c] + s[kt][2 + c];
      l[c] = l[c] * corr[c] + sum;
    }
    if (corr[0] != 1.f || corr[1] != 1.f) {
#pragma unroll
      for (int mt = 0; mt < kD / 16; ++mt) {
        o[mt][0] *= corr[0];
        o[mt][1] *= corr[1];
        o[mt][2] *= corr[0];
        o[mt][3] *= corr[1];
      }
    }
  }

  // O^T += V^T P^T over the chunk (O's channels permuted as the register kernel's).
  static __device__ __forceinline__ void Pv(const Scores& s, Out& o, const unsigned char* s_vr, int c0, int g,
                                            int t) {
#pragma unroll
    for (int kt = 0; kt < kKeyTiles; ++kt) {
      // Keys g / g + 8 x queries 2t, 2t + 1 -> queries g x keys 2t, 2t + 1 / 2t + 8, 2t + 9.
      const uint32_t pb[2] = {ptx::MovMatrixTrans(ptx::Pack2<MmaT>(s[kt][0], s[kt][1])),
                              ptx::MovMatrixTrans(ptx::Pack2<MmaT>(s[kt][2], s[kt][3]))};
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
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      l[c] += __shfl_xor_sync(0xffffffffu, l[c], 4);
      l[c] += __shfl_xor_sync(0xffffffffu, l[c], 8);
      l[c] += __shfl_xor_sync(0xffffffffu, l[c], 16);
    }
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
    if (g == 0) {
      s_m[warp * 16 + 2 * t] = m[0];
      s_m[warp * 16 + 2 * t + 1] = m[1];
      s_l[warp * 16 + 2 * t] = l[0];
      s_l[warp * 16 + 2 * t + 1] = l[1];
    }
    __syncthreads();
  }
};

template <typename T, int kD, int kWarpsM, int kWarpsN, class Variant, class Kv>
__global__ void __launch_bounds__(32 * kWarpsM * kWarpsN,
                                  (EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>::kCtasPerSm))
    DecodeSplitKernelKeyRows(const __grid_constant__ DecodeParams p) {
  using Cfg = EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>;
  using Stages = SplitStages<T, kD, kWarpsM, kWarpsN, Kv>;
  using QStages = QRegStages<T, kD, kWarpsM, kWarpsN, Kv>;
  using KStages = KeyRowStages<T, kD, kWarpsM, kWarpsN, Kv>;
  constexpr int kStages = Cfg::kStages, kChunk = Cfg::kChunk, kTileN = Cfg::kTileN;
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);
  float* s_scale = reinterpret_cast<float*>(smem + Cfg::kQBytes);
  unsigned char* s_ring = smem + Cfg::kRingOffset;

  const int split = blockIdx.x;
  const int kvh = blockIdx.y / p.m_blocks;
  const int b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, wn = tid >> 5;
  const int row0 = (blockIdx.y % p.m_blocks) * Cfg::kBlockM;
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

  // The register kernel's copies (DecodeSplitKernelQRegs: warps copy the rows they read at int4).
  constexpr bool kWarpCopies = Kv::kBits == 4;
  constexpr int kCopyRows = kWarpCopies ? Cfg::kWarpN : kTileN;
  const int copy_row0 = kWarpCopies ? wn * Cfg::kWarpN : 0, copy_tid = kWarpCopies ? lane : tid;
  constexpr int64_t kRowBytes = Kv::template RowBytes<kD>();
  const auto* k0 = static_cast<const unsigned char*>(p.k) + b * p.k_stride_b + kvh * p.k_stride_h;
  const auto* v0 = static_cast<const unsigned char*>(p.v) + b * p.v_stride_b + kvh * p.v_stride_h;
  using Stream = typename Kv::template TileStream<kD, kCopyRows, kTileN, kWarpCopies ? 32 : Cfg::kThreads,
                                                  Cfg::kKPitch, Cfg::kVPitch>;
  Stream kv_stream(k0 + copy_row0 * kRowBytes, v0 + copy_row0 * kRowBytes, t_begin, copy_tid);
  int st_load = 0;
  auto load_tile = [&](int t) {
    unsigned char* stage = s_ring + st_load * Cfg::kStageBytes;
    const int r0 = t * kTileN + copy_row0;
    kv_stream.Load(stage + copy_row0 * Cfg::kKPitch, stage + kTileN * Cfg::kKPitch + copy_row0 * Cfg::kVPitch,
                   n_begin - r0, n_end - r0, copy_tid);
    st_load = st_load + 1 == kStages ? 0 : st_load + 1;
  };

  // The lane's two query columns 2t, 2t + 1 (rows past the block's are clamped: never written).
  QueryRow<> rows[2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int R = min(row0 + 2 * t4 + c, p.rows - 1);
    const int h = kvh * p.group + R / p.q_len, i = R % p.q_len;
    rows[c].pos = pos0 + i;
    rows[c].bias_off = b * p.variant.bias_stride_b + h * p.variant.bias_stride_h + i * p.variant.bias_stride_s;
  }

  typename KStages::Out o;
#pragma unroll
  for (int mt = 0; mt < kD / 16; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};
  uint32_t qb[KStages::kSteps][2];
  // A per-tensor K scale times the column's 1 / row scale (times the variant's scale where its
  // Score is that multiply: one multiply a score), and the logit of a raw score.
  float k_mul[2] = {1.f, 1.f};
  auto logit = [&](float x, int c, int j) {
    if constexpr (Variant::kScoreIsScale) {
      return x * k_mul[c];
    } else {
      return var.Score(x * k_mul[c], rows[c], j);
    }
  };

  Kv::template LoadScales<kD, Cfg::kThreads>(s_scale, p.kv_scales, kvh, tid);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (t_begin + s < t_end) load_tile(t_begin + s);
    ptx::CpAsyncCommit();
  }

  int st_use = 0;
  for (int t = t_begin; t < t_end; ++t) {
    const int it = t - t_begin;
    ptx::CpAsyncWait<kStages - 2>();
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
      QStages::PrepareQ(s_q, s_scale, p.kv_scales.k_per_channel, tid);
      __syncthreads();
      const float k_tensor = p.kv_scales.k_per_channel ? 1.f : s_scale[0];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        k_mul[c] = k_tensor * QStages::RowUnscale(s_q, 2 * t4 + c);
        if constexpr (Variant::kScoreIsScale) k_mul[c] *= var.ScoreScale();
      }
      KStages::LoadQ(qb, s_q, lane);
    }
    const unsigned char* s_kr = s_ring + st_use * Cfg::kStageBytes;
    st_use = st_use + 1 == kStages ? 0 : st_use + 1;
    const unsigned char* s_vr = s_kr + kTileN * Cfg::kKPitch;
    const int n0 = t * kTileN;
    const bool full = n0 >= kb.full_lo && n0 + kTileN <= kb.full_hi;

#pragma unroll
    for (int ch = 0; ch < Cfg::kWarpN / kChunk; ++ch) {
      const int c0 = wn * Cfg::kWarpN + ch * kChunk;
      typename KStages::Scores s;
      KStages::Qk(s, qb, s_kr, c0, g, t4);
      // As in DecodeSplitKernel: whole visible tiles without the per-key tests (a variant's Score
      // runs on visible keys only: a bias is never read out of its bounds).
      if (full) {
#pragma unroll
        for (int kt = 0; kt < KStages::kKeyTiles; ++kt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = n0 + c0 + 16 * kt + g + 8 * (e >> 1);
            s[kt][e] = logit(s[kt][e], e & 1, j);
          }
        }
      } else {
#pragma unroll
        for (int kt = 0; kt < KStages::kKeyTiles; ++kt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = n0 + c0 + 16 * kt + g + 8 * (e >> 1);
            s[kt][e] = var.Visible(rows[e & 1], j) ? logit(s[kt][e], e & 1, j) : -INFINITY;
          }
        }
      }
      KStages::SoftmaxUpdate(s, m, l, o);
      KStages::Pv(s, o, s_vr, c0, g, t4);
    }
  }

  float* s_o = reinterpret_cast<float*>(smem + Cfg::kQBytes);
  float* s_m = s_o + Cfg::kWarps * 16 * Cfg::kOStride;
  float* s_l = s_m + Cfg::kWarps * 16;
  KStages::StageWarp(o, m, l, s_scale + kD, s_o, s_m, s_l, wn, lane);

  const bool single = p.splits == 1;
  const bool in_cluster = Cfg::kClusterCombine && p.cluster > 1;
  float* s_part = reinterpret_cast<float*>(smem + Cfg::kQBytes + Cfg::kMergeBytes);
  Stages::WriteSplit(p, s_o, s_m, s_l, s_part, single, in_cluster, b, kvh, split, row0, tid);
  if constexpr (Cfg::kClusterCombine) {
    if (in_cluster) ClusterCombine<T, kD, Cfg::kBlockM, Cfg::kThreads>(p, s_part, b, kvh, row0, tid);
  }
}

}  // namespace joa::decode
