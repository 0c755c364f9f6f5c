// The prefill engine: forward flash attention for sm_90a (H100 / H200).
//
// One CTA computes kBlockM = 128 packed query rows (192 under kTuneM192) of one (batch row, KV
// head) against the key tiles its rows can see (the variant's Bounds), kBlockN keys per step (the
// head size's Tiling, params.h: 128, or 80 at head size 256; the opt-in tunes' 176 at 128, 192 at 64):
//   - warpgroup 0, the producer (setmaxnreg down to 24 registers): one thread issues the bulk
//     tensor copies (TMA) of the Q tile once and of K / V tiles into stages-deep rings of
//     128-byte-swizzled shared memory, each completing on its mbarrier ("full"); it reuses a K or
//     V slot once every consumer has released it ("empty", K and V apart).
//   - warpgroups 1 and 2 (and 3 under kTuneM192), the consumers (240 registers; 160 with three),
//     64 query rows each: S = Q K^T with wgmma (both operands in shared memory, K-major), the
//     variant's mask and scale, online softmax in registers in the log2 domain (f32 row max / sum,
//     exp2), P converted to f16 / bf16 in registers, O += P V with wgmma (P from registers, V
//     MN-major in shared memory), f32 O.
//   - the epilogue divides by the row sum, stages O in shared memory (the warpgroup's Q rows)
//     and writes the valid rows with 16-byte stores.
//   - split-KV (kSplit kernels, p.splits > 1, plan.h): the CTA visits only its split's share of
//     those key tiles and writes an f32 partial O and its log-sum-exp to the workspace
//     (SplitEpilogue); combine.cuh merges the splits into y in a fixed order. A template
//     parameter, so the kernels without it are unchanged.
// No float atomics and no cross-CTA reduction: the bits depend on the static shapes only.
//
// Keys at or past kv_len may hold anything (NaN included): their logits are masked to -inf by a
// select, and the V rows of a tile that crosses kv_len are zeroed in shared memory before P V (so
// 0 * NaN never reaches O), as the reference zeroes them.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>
#include <type_traits>

#include "kernels/common/variant.cuh"
#include "kernels/prefill/params.h"
#include "kernels/prefill/sm90.cuh"
#include "kernels/ptx.cuh"

namespace joa::prefill {

// A variant whose softmax adds a per-query-head sink: an extra logit sink[h] (natural units,
// VariantParams::sink, f32 [Hq]) in the max and the denominator, no value row (attention sinks;
// GQA's head_sink, smooth softmax = a sink of 0). Nothing changes per key: the epilogue adds it once,
// as the decode engine's does. A separate instantiation, so kernels without sinks are unchanged.
template <class Base>
struct WithSink : Base {
  using Base::Base;
};
template <class V>
inline constexpr bool kHasSink = false;
template <class B>
inline constexpr bool kHasSink<WithSink<B>> = true;

// Whether a variant's Score is the plain scale (MaskVariant, with or without sinks): what
// kTuneFold (params.h) folds into the exp2 argument. Other variants ignore the fold bit.
template <class V>
inline constexpr bool kPlainScore = std::is_same_v<V, MaskVariant> || std::is_same_v<V, WithSink<MaskVariant>>;

// What one CTA does: its packed rows [r0, r0 + block_m) of the M rows of its (b, kvh), the valid
// lengths of its batch row, and the key tiles [n_begin, n_end) it visits (its split's share of the
// tiles its rows see); tiles inside [full_lo, full_hi) need no per-element mask.
struct CtaWork {
  int r0, q_len, kv_len, shift;  // shift: position of query row i is shift + i
  int n_begin, n_end, full_lo, full_hi;
  int split;  // its key range of p.splits (0 without split-KV)
};

template <int kBlockM, int kBlockN, bool kSplit, class Variant>
__device__ __forceinline__ CtaWork PlanCta(const PrefillParams& p, const Variant& var, int m_block, int split,
                                           int q_len, int kv_len) {
  CtaWork w;
  w.split = split;
  const int s = p.q_rows;
  w.r0 = m_block * kBlockM;
  w.q_len = q_len;
  w.kv_len = kv_len;
  w.shift = kv_len - q_len;
  const int r_last = min(w.r0 + kBlockM, p.rows) - 1;
  // The query rows i this tile holds: a run inside one head, or (crossing a head) all of them.
  int i_min = 0, i_max = s - 1;
  if (w.r0 / s == r_last / s) {
    i_min = w.r0 % s;
    i_max = r_last % s;
  }
  i_max = min(i_max, q_len - 1);
  w.n_begin = w.n_end = 0;
  w.full_lo = w.full_hi = 0;
  if (i_min <= i_max) {
    const KeyBounds k = var.Bounds(w.shift + i_min, w.shift + i_max);
    if (k.hi > k.lo) {
      w.n_begin = k.lo / kBlockN;
      w.n_end = (k.hi + kBlockN - 1) / kBlockN;
      w.full_lo = k.full_lo;
      w.full_hi = k.full_hi;
    }
  }
  if constexpr (kSplit) {
    // Split-KV: whole tiles, split s takes [n_begin + s * per, + per) of the visible range (FA3's
    // cut); the last splits may get fewer or none (an empty split writes lse = -inf). The masks are
    // absolute key positions (full_lo / full_hi, the rows' spans), so they hold in any split.
    const int per = (w.n_end - w.n_begin + p.splits - 1) / p.splits;
    const int lo = min(w.n_begin + split * per, w.n_end);
    w.n_end = min(lo + per, w.n_end);
    w.n_begin = lo;
  }
  return w;
}

// The shared-memory plan of one CTA (byte offsets from the 1024-aligned base) and the head size's
// static tiling (params.h TilingFor: the one source of truth; TunedTiling under a tune's tiling bits).
// kQBuffers: 1, or 2 in the persistent kernels (a CTA loads its next tile's Q while it finishes this
// one's); the one-buffer plan is the layout the other kernels always had.
template <int kD, int kTune = kTuneNone, int kQBuffers = 1>
struct Smem {
  static constexpr Tiling kTiling = TunedTiling(kD, kTune);
  static_assert(kTiling.padded > 0 && kD % 16 == 0, "a head size of kHeadDims");
  static_assert(TilingFits(kD, kTune), "params.h TilingFits: wgmma N, TMA box, shared memory, registers");
  static_assert(kQBuffers == 1 || (kQBuffers == 2 && PersistentFits(kD, kTune)), "params.h PersistentFits");
  static constexpr int kPadded = kTiling.padded;   // tile and O width (d <= kPadded)
  static constexpr int kBlockN = kTiling.block_n;  // keys per step
  static constexpr int kStages = kTiling.stages;   // K / V ring depth
  static constexpr int kBlockM = kTiling.block_m;  // packed query rows
  static constexpr int kConsumers = Consumers(kTiling);
  static constexpr int kThreads = Threads(kTiling);
  static constexpr int kConsumerRegisters = ConsumerRegisters(kTiling);
  static constexpr int kChunks = kPadded / 64;                // 64-column (128-byte) blocks of a row
  static constexpr int kQChunkBytes = kBlockM * 128;          // one column block of the Q tile
  static constexpr int kKVChunkBytes = kBlockN * 128;         // ... of a K or V tile
  static_assert(kKVChunkBytes % 1024 == 0 && kBlockN % 16 == 0, "whole swizzle atoms and k-steps");
  static constexpr int kQTileBytes = kChunks * kQChunkBytes;
  static constexpr int kKVTileBytes = kChunks * kKVChunkBytes;
  static constexpr int kQ = 0;  // Q buffer b at kQ + b * kQTileBytes
  static constexpr int kK = kQ + kQBuffers * kQTileBytes;
  static constexpr int kV = kK + kStages * kKVTileBytes;
  static constexpr int kBars = kV + kStages * kKVTileBytes;
  // Barriers (8 bytes each): q_full[kQBuffers], k_full[kStages], v_full[kStages], k_empty[kStages],
  // v_empty[kStages], then q_empty[kQBuffers] with two Q buffers (one buffer is loaded once: no
  // q_empty, the offsets as before). K and V slots are released apart: a K slot as soon as Q K^T
  // has read it (the overlapped schedules read V of a tile one step later).
  static constexpr int QFull(int b = 0) { return kBars + 8 * b; }
  static constexpr int KFull(int s) { return kBars + 8 * (kQBuffers + s); }
  static constexpr int VFull(int s) { return kBars + 8 * (kQBuffers + kStages + s); }
  static constexpr int KEmpty(int s) { return kBars + 8 * (kQBuffers + 2 * kStages + s); }
  static constexpr int VEmpty(int s) { return kBars + 8 * (kQBuffers + 3 * kStages + s); }
  static constexpr int QEmpty(int b) { return kBars + 8 * (kQBuffers + 4 * kStages + b); }
  static constexpr int kEnd = kBars + 8 * (kQBuffers + 4 * kStages + (kQBuffers > 1 ? kQBuffers : 0));
  static_assert(kEnd + 1024 <= SmemBytes(kD, kTune, kQBuffers), "SmemBytes(d) must cover the plan");
};

// The loads of one CTA tile (thread 0 of the producer warpgroup): its Q tile into the Q buffer at
// q_dst, completing on q_full, then its K / V tiles through the ring from ring iteration it0 on (the
// persistent kernels' ring and its barrier phases run on across a CTA's tiles; 0 otherwise).
template <class L>
__device__ __forceinline__ void LoadTile(const CUtensorMap& q_map, const CUtensorMap& k_map, const CUtensorMap& v_map,
                                         uint32_t base, const CtaWork& w, int bh, const PrefillParams& p,
                                         uint32_t q_dst, uint32_t q_full, int it0) {
  const int q_row = bh * p.rows + w.r0;  // < 2^31: checked by the handler
  sm90::MbarArriveExpectTx(q_full, L::kQTileBytes);
#pragma unroll
  for (int c = 0; c < L::kChunks; ++c) {
    sm90::TmaLoad2D(q_dst + c * L::kQChunkBytes, &q_map, c * 64, q_row, q_full);
  }
  // K runs one tile ahead of V (FA3's order): the overlapped schedules need K of tile n + 1 and V of
  // tile n together, and a K slot frees early (after Q K^T) while a V slot frees only after P V, so
  // K n + 1 is not queued behind the wait for V n's slot. The serial schedule needs K n, then V n:
  // K n + 1 waits for K n - 1's slot, released before V n - 1 is ever waited for, so no cycle.
  auto load_k = [&](int it) {
    const int s = (it0 + it) % L::kStages;
    sm90::MbarWait(base + L::KEmpty(s), (((it0 + it) / L::kStages) & 1) ^ 1);
    sm90::MbarArriveExpectTx(base + L::KFull(s), L::kKVTileBytes);
#pragma unroll
    for (int c = 0; c < L::kChunks; ++c) {
      sm90::TmaLoad2D(base + L::kK + s * L::kKVTileBytes + c * L::kKVChunkBytes, &k_map, c * 64,
                      bh * p.kv_rows + (w.n_begin + it) * L::kBlockN, base + L::KFull(s));
    }
  };
  auto load_v = [&](int it) {
    const int s = (it0 + it) % L::kStages;
    sm90::MbarWait(base + L::VEmpty(s), (((it0 + it) / L::kStages) & 1) ^ 1);
    sm90::MbarArriveExpectTx(base + L::VFull(s), L::kKVTileBytes);
#pragma unroll
    for (int c = 0; c < L::kChunks; ++c) {
      sm90::TmaLoad2D(base + L::kV + s * L::kKVTileBytes + c * L::kKVChunkBytes, &v_map, c * 64,
                      bh * p.kv_rows + (w.n_begin + it) * L::kBlockN, base + L::VFull(s));
    }
  };
  const int n_tiles = w.n_end - w.n_begin;
  load_k(0);
  for (int it = 0; it < n_tiles; ++it) {
    if (it + 1 < n_tiles) load_k(it + 1);
    load_v(it);
  }
}

// The one-tile kernels' producer: its tile's loads into the single Q buffer and a fresh ring.
template <typename T, int kD, class Variant, int kTune = kTuneNone>
__device__ __forceinline__ void Produce(const CUtensorMap& q_map, const CUtensorMap& k_map,
                                        const CUtensorMap& v_map, uint32_t base, const CtaWork& w,
                                        int bh, const PrefillParams& p) {
  using L = Smem<kD, kTune>;
  sm90::PrefetchTensorMap(&q_map);
  sm90::PrefetchTensorMap(&k_map);
  sm90::PrefetchTensorMap(&v_map);
  LoadTile<L>(q_map, k_map, v_map, base, w, bh, p, base + L::kQ, base + L::QFull(), 0);
}

// The steps of one consumer warpgroup on one key tile. Accumulator layout (wgmma m64nN, f32): this
// thread holds rows lane / 4 (+ 8) of its warp's 16 and, per 8 columns c8, columns
// 8 * c8 + 2 * (lane % 4) + {0, 1}: element e is row half (e / 2) % 2, column (e / 4) * 8 + ...
template <typename T, int kD, class Variant, int kTune = kTuneNone>
struct ConsumerSteps {
  using L = Smem<kD, kTune>;
  // kTuneFold / kTuneLazy (params.h): the raw scores' max and one FFMA per element; the O rescale
  // skipped when the warp's rows kept their max.
  static constexpr bool kFold = (kTune & kTuneFold) != 0 && kPlainScore<Variant>;
  static constexpr bool kLazy = (kTune & kTuneLazy) != 0;
  static constexpr int kChunks = L::kChunks;
  static constexpr int kBlockN = L::kBlockN;
  static constexpr int kKSteps = kBlockN / 16;  // P V k-steps
  static constexpr int kSc = kBlockN / 2;       // this thread's part of the 64 x kBlockN S (and P)
  static constexpr int kO = L::kPadded / 2;     // ... of the 64 x kPadded O

  // S = Q K^T: kD / 16 steps of m64n(kBlockN)k16, 32 bytes along the swizzled row per step (the
  // zero columns of a padded tile, past kD, are never read). Issued, not waited for.
  static __device__ __forceinline__ void IssueQK(float (&sc)[kSc], uint32_t q_base, uint32_t k_base) {
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t q_off = (kk / 4) * L::kQChunkBytes + (kk % 4) * 32;
      const uint32_t k_off = (kk / 4) * L::kKVChunkBytes + (kk % 4) * 32;
      sm90::WgmmaSS<T, kBlockN>(sc, sm90::SmemDesc(q_base + q_off, 16, 1024),
                                sm90::SmemDesc(k_base + k_off, 16, 1024), kk > 0);
    }
    sm90::WgmmaCommit();
  }

  // O += P V: kBlockN / 16 steps of one m64n(kPadded)k16 each (P from registers, V MN-major: a step
  // is 16 rows of 128 bytes; the 64-column blocks of V are L::kKVChunkBytes apart, the descriptor's
  // leading byte offset). One instruction per k-step, not one per 64 columns: the A fragment is
  // read once and the tensor core gets its widest N. Issued, not waited for.
  static __device__ __forceinline__ void IssuePV(float (&o)[kO], const uint32_t (&pa)[kKSteps][4],
                                                 uint32_t v_base) {
#pragma unroll
    for (int t = 0; t < kKSteps; ++t) {
      sm90::WgmmaRS<T, L::kPadded>(o, pa[t], sm90::SmemDesc(v_base + t * 16 * 128, L::kKVChunkBytes, 1024), 1);
    }
    sm90::WgmmaCommit();
  }

  // The tile's logits in the log2 domain (hidden keys -inf by a select: a NaN logit of a hidden key
  // drops), the running max m, the running partial sums l, and P = exp2(x - max) in place in sc.
  // Returns the factors alpha[2] that rescale O from the old max to the new one.
  //
  // kMasked: the tile is not inside every row's visible keys, so each element is tested against its
  // row's visible interval: key j0 + c is visible iff lo[h] <= c < hi[h] (VisibleSpan: the row's
  // [lo, hi) less j0 and this thread's column 2 * quad), two integer compares against a constant
  // column c and one select. Unmasked tiles do no per-element integer work at all. The row max runs
  // as four independent chains per row (max is exact, so the order does not change any bit) instead
  // of one chain of 32 dependent max.NaN.
  //
  // kFold: sc, m and the max are raw Q K^T scores (scale_log2 > 0, so the max commutes with the
  // scaling); alpha = ex2((m_old - m_new) * scale_log2) (exactly 1 when the max stays) and
  // P = ex2(fma(s, scale_log2, -m_new * scale_log2)), FA3's softmax. m stays raw: the epilogue
  // scales it where it needs the log2 domain (sinks).
  template <bool kMasked>
  static __device__ __forceinline__ void Softmax(float (&sc)[kSc], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                                 const Variant& var, const QueryRow<int> (&row)[2], int jq,
                                                 const int (&lo)[2], const int (&hi)[2], float scale_log2) {
    float mx[2][4];
#pragma unroll
    for (int e = 0; e < kSc; ++e) {
      const int h = (e / 2) % 2;
      const int c = (e / 4) * 8 + e % 2;  // column within the tile, less 2 * quad
      float x;
      if constexpr (kFold) {
        x = sc[e];
      } else {
        x = var.Score(sc[e], row[h], jq + c);
      }
      if constexpr (kMasked) x = (c >= lo[h] && c < hi[h]) ? x : -INFINITY;
      sc[e] = x;
      // Elements e of row h: e % 4 in {2h, 2h + 1}; chain k takes e / 4 = k (mod 2) and e % 2.
      const int k = ((e / 4) % 2) * 2 + e % 2;
      mx[h][k] = e < 8 ? x : ptx::MaxNan(mx[h][k], x);
    }
    float shift[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mh = ptx::MaxNan(ptx::MaxNan(mx[h][0], mx[h][1]), ptx::MaxNan(mx[h][2], mx[h][3]));
      mh = ptx::MaxNan(m[h], mh);
      mh = ptx::MaxNan(mh, __shfl_xor_sync(0xffffffffu, mh, 1));
      mh = ptx::MaxNan(mh, __shfl_xor_sync(0xffffffffu, mh, 2));
      // A row with no visible key yet is shifted by 0: exp2(-inf) = 0, never NaN.
      shift[h] = mh == -INFINITY ? 0.f : mh;
      if constexpr (kFold) {
        alpha[h] = ptx::Exp2(__fmul_rn(__fsub_rn(m[h], shift[h]), scale_log2));
        shift[h] = -__fmul_rn(shift[h], scale_log2);  // the FFMA's addend
      } else {
        alpha[h] = ptx::Exp2(m[h] - shift[h]);
      }
      m[h] = mh;
      l[h] = __fmul_rn(l[h], alpha[h]);
    }
    // Explicitly rounded adds (never contracted into an FMA): every schedule inlines this step in
    // other code, and their bits must agree.
#pragma unroll
    for (int e = 0; e < kSc; ++e) {
      const int h = (e / 2) % 2;
      if constexpr (kFold) {
        sc[e] = ptx::Exp2(__fmaf_rn(sc[e], scale_log2, shift[h]));
      } else {
        sc[e] = ptx::Exp2(__fsub_rn(sc[e], shift[h]));
      }
      l[h] = __fadd_rn(l[h], sc[e]);
    }
  }

  // Softmax with the mask decided per tile (a warp-uniform branch, each side straight-line code).
  // span_lo / span_hi: the rows' visible keys [lo, hi) less 2 * quad (VisibleSpan).
  static __device__ __forceinline__ void SoftmaxTile(float (&sc)[kSc], float (&m)[2], float (&l)[2],
                                                     float (&alpha)[2], const Variant& var,
                                                     const QueryRow<int> (&row)[2], int j0, bool masked, int quad,
                                                     const int (&span_lo)[2], const int (&span_hi)[2],
                                                     float scale_log2) {
    const int jq = j0 + 2 * quad;  // this thread's first key of the tile
    if (masked) {
      const int lo[2] = {span_lo[0] - j0, span_lo[1] - j0}, hi[2] = {span_hi[0] - j0, span_hi[1] - j0};
      Softmax<true>(sc, m, l, alpha, var, row, jq, lo, hi, scale_log2);
    } else {
      Softmax<false>(sc, m, l, alpha, var, row, jq, span_lo, span_hi, scale_log2);
    }
  }

  // P as the A operand of P V (the mma.sync A layout per k-step of 16 keys), and O rescaled.
  static __device__ __forceinline__ void PackAndRescale(const float (&sc)[kSc], uint32_t (&pa)[kKSteps][4],
                                                        float (&o)[kO], const float (&alpha)[2]) {
#pragma unroll
    for (int t = 0; t < kKSteps; ++t) {
#pragma unroll
      for (int a = 0; a < 4; ++a) pa[t][a] = ptx::Pack2<T>(sc[8 * t + 2 * a], sc[8 * t + 2 * a + 1]);
    }
    if constexpr (kLazy) {
      // x * 1 is exact: skipping the rescale when no row of the warp moved its max keeps the bits.
      // alpha != 1 is true for NaN too (NaN rows still poison O, as without the skip).
      if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
    }
#pragma unroll
    for (int e = 0; e < kO; ++e) o[e] = __fmul_rn(o[e], alpha[(e / 2) % 2]);
  }

  // Before P V of a tile that crosses kv_len: zero its V rows at or past kv_len (both warpgroups
  // write the same zeros) and order the writes before the tensor cores read them.
  static __device__ __forceinline__ void ZeroTail(uint8_t* v_ptr, int j0, int kv_len, int tid, int wg) {
    if (j0 + kBlockN <= kv_len) return;
    const int first = max(kv_len - j0, 0);
    const int pieces = (kBlockN - first) * 8;  // 16-byte pieces per column block
    for (int idx = tid; idx < kChunks * pieces; idx += 128) {
      const int c = idx / pieces, rem = idx % pieces;
      *reinterpret_cast<uint4*>(v_ptr + c * L::kKVChunkBytes + (first + rem / 8) * 128 + (rem % 8) * 16) =
          make_uint4(0, 0, 0, 0);
    }
    sm90::FenceProxyAsync();
    sm90::NamedBarrierSync(1 + wg, 128);
  }
};

// The epilogue of a split (p.splits > 1): this thread's two rows' normalised f32 partial O (O / l)
// and log2-sum-exp (m + log2 l, log2 domain: combine.cuh weighs splits by exp2(lse - max)) go to the
// workspace, straight from the accumulator layout (a quad writes 32 contiguous bytes of a row, whole
// sectors). Rows past q_len and rows this split saw no key of write lse = -inf and no O (the
// combine never reads a partial of weight 0); a NaN max or sum stays NaN in lse and poisons the row
// in the combine. No sink here: the combine adds it once. Rows past this KV head's M belong to
// another (b, kvh) and are left alone.
template <class Step, int kD>
__device__ __forceinline__ void SplitEpilogue(const float (&o)[Step::kO], const float (&m)[2], float (&l)[2],
                                              const int (&r)[2], const CtaWork& w, int bh, float scale_log2,
                                              const PrefillParams& p) {
  const int quad = threadIdx.x % 4;
  const int64_t part_row0 = (int64_t(bh) * p.splits + w.split) * p.rows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    if (r[h] >= p.rows) continue;
    const bool live = r[h] % p.q_rows < w.q_len;
    // kTuneFold keeps m raw: to the log2 domain here (-inf and NaN stay so).
    const float m_log2 = Step::kFold ? __fmul_rn(m[h], scale_log2) : m[h];
    const float lse = !live || l[h] == 0.f ? -INFINITY : m_log2 + log2f(l[h]);
    if (quad == 0) p.part_lse[part_row0 + r[h]] = lse;
    if (lse == -INFINITY) continue;
    const float inv = 1.f / l[h];
    float* dst = p.part_o + (part_row0 + r[h]) * kD + 2 * quad;
#pragma unroll
    for (int c = 0; c < Step::kChunks; ++c) {
#pragma unroll
      for (int n8 = 0; n8 < 8; ++n8) {
        if (c * 64 + n8 * 8 >= kD) continue;  // a padded tile's columns past kD
        const int e = 32 * c + n8 * 4 + 2 * h;
        *reinterpret_cast<float2*>(dst + c * 64 + n8 * 8) = make_float2(o[e] * inv, o[e + 1] * inv);
      }
    }
  }
}

// Ping-pong turns, round robin over the kConsumers warpgroups: consumer wg issues its tensor-core
// work between TakeTurn and PassTurn; barrier kTurnBarrier + wg completes when wg syncs on it (128
// threads) and the warpgroup before it arrives (128).
template <int kConsumers>
inline constexpr int kTurnBarrier = 1 + kConsumers;  // 1 .. kConsumers: ZeroTail's per-warpgroup barriers

template <Schedule kSchedule, int kConsumers>
__device__ __forceinline__ void TakeTurn(int wg) {
  if constexpr (kSchedule == Schedule::kPingPong) sm90::NamedBarrierSync(kTurnBarrier<kConsumers> + wg, 256);
}

template <Schedule kSchedule, int kConsumers>
__device__ __forceinline__ void PassTurn(int wg) {
  if constexpr (kSchedule == Schedule::kPingPong) {
    const int next = kConsumers == 2 ? 1 - wg : (wg + 1) % kConsumers;
    sm90::NamedBarrierArrive(kTurnBarrier<kConsumers> + next, 256);
  }
}

// One consumer warpgroup (wg 0 .. kConsumers - 1): rows [64 * wg, 64 * wg + 64) of the CTA tile, in
// the order of kSchedule (params.h). All warpgroups visit the same n_tiles key tiles. Ping-pong: each
// issues n_tiles + 1 times (prologue, n_tiles - 1 loop steps, epilogue), warpgroup 0 first, then
// round robin; the last warpgroup passes the first turn (to warpgroup 0) at the start and no turn
// after its last issue, so every barrier phase sees 128 syncs and 128 arrivals.
// kPersistent (the persistent kernels, one call per tile of the CTA): the tile's Q sits q_off bytes
// past L::kQ (its Q buffer; the caller waited for it) and its key tiles take the K / V ring from
// iteration it0 on. The turns run round robin across the CTA's tiles: the last warpgroup passes
// after its last issue too (to warpgroup 0's first issue of the next tile, so that issues while
// the others finish their epilogues) and not at the start of a tile; RunPersistent makes the
// CTA's first pass and takes the last one, so every phase still sees 128 syncs and 128 arrivals.
// ZeroTail's and the epilogue's per-warpgroup barriers complete within the call.
template <typename T, int kD, class Variant, Schedule kSchedule, int kTune = kTuneNone, bool kSplit = false,
          bool kPersistent = false>
__device__ __forceinline__ void Consume(uint32_t base, uint8_t* base_ptr, const CtaWork& w, const Variant& var,
                                        int wg, int bh, const PrefillParams& p, uint32_t q_off = 0, int it0 = 0) {
  using L = Smem<kD, kTune, kPersistent ? 2 : 1>;
  using Step = ConsumerSteps<T, kD, Variant, kTune>;
  // kTuneFold's factor (MaskVariant's scale_log2; unused without the fold).
  const float scale_log2 = p.variant.scale * kLog2e;
  constexpr int kChunks = L::kChunks;
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int quad = lane % 4;
  // The two packed rows this thread holds, and the keys each sees: one interval per row (the
  // variant's Bounds of a single position: valid length, causal, windows), less 2 * quad so that a
  // masked tile compares it with compile-time columns.
  int r[2], span_lo[2], span_hi[2];
  QueryRow<int> row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    r[h] = w.r0 + 64 * wg + 16 * warp + lane / 4 + 8 * h;
    row[h] = QueryRow<int>{w.shift + r[h] % p.q_rows, 0};
    const KeyBounds span = var.Bounds(row[h].pos, row[h].pos);
    span_lo[h] = span.lo - 2 * quad;
    span_hi[h] = span.hi - 2 * quad;
  }

  constexpr int kBlockN = L::kBlockN, kStages = L::kStages;
  // This thread's part of the warpgroup's 64 x kPadded O (the wgmma m64n(kPadded) layout).
  float o[Step::kO];
#pragma unroll
  for (int e = 0; e < Step::kO; ++e) o[e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};  // this thread's part of the row sums (the quad's sum at the end)

  const int n_tiles = w.n_end - w.n_begin;
  if (n_tiles > 0) {
    if constexpr (!kPersistent) sm90::MbarWait(base + L::QFull(), 0);
    const uint32_t q_base = base + L::kQ + q_off + wg * 64 * 128;  // this warpgroup's 64 rows
    auto stage = [it0](int it) { return (it0 + it) % kStages; };
    auto phase = [it0](int it) { return uint32_t((it0 + it) / kStages) & 1; };
    auto masked = [&](int j0) { return !(j0 >= w.full_lo && j0 + kBlockN <= w.full_hi); };
    float sc[Step::kSc], alpha[2];
    uint32_t pa[Step::kKSteps][4];
    if constexpr (kSchedule == Schedule::kSerial) {
      for (int it = 0; it < n_tiles; ++it) {
        const int s = stage(it), j0 = (w.n_begin + it) * kBlockN;
        sm90::MbarWait(base + L::KFull(s), phase(it));
        sm90::WgmmaFence();
        Step::IssueQK(sc, q_base, base + L::kK + s * L::kKVTileBytes);
        sm90::WgmmaWait<0>();
        sm90::FenceOperands(sc);
        if (tid == 0) sm90::MbarArrive(base + L::KEmpty(s));  // this warpgroup is done with K slot s
        Step::SoftmaxTile(sc, m, l, alpha, var, row, j0, masked(j0), quad, span_lo, span_hi, scale_log2);
        Step::PackAndRescale(sc, pa, o, alpha);
        sm90::MbarWait(base + L::VFull(s), phase(it));
        Step::ZeroTail(base_ptr + L::kV + s * L::kKVTileBytes, j0, w.kv_len, tid, wg);
        sm90::FenceOperands(o);
        sm90::WgmmaFence();
        Step::IssuePV(o, pa, base + L::kV + s * L::kKVTileBytes);
        sm90::WgmmaWait<0>();
        sm90::FenceOperands(o);
        if (tid == 0) sm90::MbarArrive(base + L::VEmpty(s));  // ... and with V slot s
      }
    } else {
      if constexpr (!kPersistent) {
        if (wg == L::kConsumers - 1) PassTurn<kSchedule, L::kConsumers>(wg);  // warpgroup 0 issues first
      }
      // Prologue: S and P of the first tile.
      {
        const int j0 = w.n_begin * kBlockN, s = stage(0);
        sm90::MbarWait(base + L::KFull(s), phase(0));
        TakeTurn<kSchedule, L::kConsumers>(wg);
        sm90::WgmmaFence();
        Step::IssueQK(sc, q_base, base + L::kK + s * L::kKVTileBytes);
        PassTurn<kSchedule, L::kConsumers>(wg);
        sm90::WgmmaWait<0>();
        sm90::FenceOperands(sc);
        if (tid == 0) sm90::MbarArrive(base + L::KEmpty(s));
        Step::SoftmaxTile(sc, m, l, alpha, var, row, j0, masked(j0), quad, span_lo, span_hi, scale_log2);
        Step::PackAndRescale(sc, pa, o, alpha);
      }
      for (int it = 1; it < n_tiles; ++it) {
        const int s = stage(it), prev = stage(it - 1), j0 = (w.n_begin + it) * kBlockN;
        sm90::MbarWait(base + L::KFull(s), phase(it));
        sm90::MbarWait(base + L::VFull(prev), phase(it - 1));  // only the last tile crosses kv_len
        sm90::FenceOperands(o);
        TakeTurn<kSchedule, L::kConsumers>(wg);
        sm90::WgmmaFence();
        Step::IssueQK(sc, q_base, base + L::kK + s * L::kKVTileBytes);
        Step::IssuePV(o, pa, base + L::kV + prev * L::kKVTileBytes);
        PassTurn<kSchedule, L::kConsumers>(wg);
        sm90::WgmmaWait<1>();  // Q K^T done (groups complete in order); P V may still run
        sm90::FenceOperands(sc);
        if (tid == 0) sm90::MbarArrive(base + L::KEmpty(s));
        Step::SoftmaxTile(sc, m, l, alpha, var, row, j0, masked(j0), quad, span_lo, span_hi, scale_log2);
        sm90::WgmmaWait<0>();  // P V done: pa and V slot prev are free
        sm90::FenceOperands(pa);
        sm90::FenceOperands(o);
        if (tid == 0) sm90::MbarArrive(base + L::VEmpty(prev));
        Step::PackAndRescale(sc, pa, o, alpha);
      }
      // Epilogue: P V of the last tile.
      const int last = n_tiles - 1, s = stage(last), j0 = (w.n_begin + last) * kBlockN;
      sm90::MbarWait(base + L::VFull(s), phase(last));
      Step::ZeroTail(base_ptr + L::kV + s * L::kKVTileBytes, j0, w.kv_len, tid, wg);
      sm90::FenceOperands(o);
      TakeTurn<kSchedule, L::kConsumers>(wg);
      sm90::WgmmaFence();
      Step::IssuePV(o, pa, base + L::kV + s * L::kKVTileBytes);
      // The last warpgroup's last issue passes no turn (written wg == 0 for two: their kernels as
      // before), but in the persistent kernels.
      if (kPersistent || (L::kConsumers == 2 ? wg == 0 : wg != L::kConsumers - 1)) {
        PassTurn<kSchedule, L::kConsumers>(wg);
      }
      sm90::WgmmaWait<0>();
      sm90::FenceOperands(pa);
      sm90::FenceOperands(o);
      if (tid == 0) sm90::MbarArrive(base + L::VEmpty(s));
    }
  }

  if constexpr (kSplit) {  // the split kernels' epilogue, then done
    SplitEpilogue<Step, kD>(o, m, l, r, w, bh, scale_log2, p);
    return;
  }

  // Epilogue: O / rowsum, zeros for rows past q_len (and rows that saw no key: l = 0, O = 0; with a
  // sink too: the sink has no value row),
  // staged through this warpgroup's Q rows (free: all its wgmma groups are waited for) in the
  // 128-byte-swizzled [rows][64] layout, so that a warp's 16-byte global stores cover whole rows.
  // Rows past this KV head's M rows belong to another CTA and are left alone.
  uint8_t* staged = base_ptr + L::kQ + q_off + wg * 64 * 128;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    float num = 1.f;  // O's factor besides 1 / rowsum
    if constexpr (kHasSink<Variant>) {
      // The decode engine's math: the row max becomes max(m, sink) (NaN-propagating); O and l, kept
      // against m, rescale by exp2(m - max) (0 for a row without keys: m = -inf) and the sink adds
      // exp2(sink - max) to l. A row with neither keys nor a finite sink keeps l = 0 and gives 0.
      // The query head of packed row r; rows past this KV head's M (never written) clamp to its last.
      const int head = (bh % p.kv_heads) * p.group + min(r[h] / p.q_rows, p.group - 1);
      const float sink = SinkLog2(p.variant.sink, head);
      // kTuneFold keeps m raw: to the log2 domain here (-inf and NaN stay so).
      const float m_log2 = Step::kFold ? __fmul_rn(m[h], scale_log2) : m[h];
      const float mx = ptx::MaxNan(m_log2, sink);
      const float m_use = mx == -INFINITY ? 0.f : mx;
      num = ptx::Exp2(m_log2 - m_use);
      l[h] = __fadd_rn(__fmul_rn(l[h], num), ptx::Exp2(sink - m_use));
    }
    const float inv = l[h] == 0.f ? 0.f : num / l[h];  // NaN stays NaN
    const bool live = r[h] % p.q_rows < w.q_len;
    const int rr = 16 * warp + lane / 4 + 8 * h;  // row within the warpgroup's 64
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int n8 = 0; n8 < 8; ++n8) {  // 8 columns = one 16-byte piece, swizzled by row % 8
        if (c * 64 + n8 * 8 >= kD) continue;  // a padded tile's columns past kD: never written
        const int e = n8 * 4 + 2 * h;
        const float v0 = live ? o[32 * c + e] * inv : 0.f, v1 = live ? o[32 * c + e + 1] * inv : 0.f;
        *reinterpret_cast<uint32_t*>(staged + c * L::kQChunkBytes + rr * 128 + ((n8 ^ (rr % 8)) * 16) + quad * 4) =
            ptx::Pack2<T>(v0, v1);
      }
    }
  }
  sm90::NamedBarrierSync(1 + wg, 128);
  T* y = static_cast<T*>(p.y);
  constexpr int kPieces = kD / 8;  // 16-byte pieces of a row of y
#pragma unroll
  for (int idx = tid; idx < 64 * kPieces; idx += 128) {
    // (idx % kPieces) % 8 is idx % 8 when a row is whole column blocks: written so, as before.
    const int rr = idx / kPieces, c = (idx % kPieces) / 8, n8 = kPieces % 8 == 0 ? idx % 8 : (idx % kPieces) % 8;
    const int row_m = w.r0 + 64 * wg + rr;
    if (row_m >= p.rows) continue;
    const uint4 piece =
        *reinterpret_cast<const uint4*>(staged + c * L::kQChunkBytes + rr * 128 + ((n8 ^ (rr % 8)) * 16));
    *reinterpret_cast<uint4*>(y + (int64_t(bh) * p.rows + row_m) * kD + c * 64 + n8 * 8) = piece;
  }
}

// The CTA's (b * Hkv + kvh, M block, split) from its linear index (see PrefillKernel).
struct CtaIndex {
  int bh, m_block, split;
};
template <bool kSplit>
__device__ __forceinline__ CtaIndex IndexCta(const PrefillParams& p) {
  if constexpr (kSplit) {  // the splits of an M block next to each other
    const int per_head = p.m_blocks * p.splits;
    const int in_head = int(blockIdx.x % per_head);
    return {int(blockIdx.x / per_head), p.m_blocks - 1 - in_head / p.splits, in_head % p.splits};
  } else {
    return {int(blockIdx.x / p.m_blocks), p.m_blocks - 1 - int(blockIdx.x % p.m_blocks), 0};
  }
}

// The CTA's mbarriers, initialised once by thread 0 and published to the CTA: q_full (one arrival,
// the producer's) and, with two Q buffers, q_empty (one a consumer warpgroup) per buffer, then the
// ring's full / empty pairs (Smem's barrier plan).
template <class L, int kQBuffers>
__device__ __forceinline__ void InitBarriers(uint32_t base) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int b = 0; b < kQBuffers; ++b) {
      sm90::MbarInit(base + L::QFull(b), 1);
      if constexpr (kQBuffers > 1) sm90::MbarInit(base + L::QEmpty(b), L::kConsumers);
    }
#pragma unroll
    for (int s = 0; s < L::kStages; ++s) {
      sm90::MbarInit(base + L::KFull(s), 1);
      sm90::MbarInit(base + L::VFull(s), 1);
      sm90::MbarInit(base + L::KEmpty(s), L::kConsumers);
      sm90::MbarInit(base + L::VEmpty(s), L::kConsumers);
    }
    sm90::FenceBarrierInit();
  }
  __syncthreads();
}

// The persistent kernels' tile t (of B * Hkv * m_blocks; grid: launch.cu Launch): a static order,
// longest first within sections of section_heads (b, kvh) heads (params.h PersistentSectionHeads,
// FA3's L2 swizzle: a section's K / V fits in L2, so the tiles running at once share it): a section's
// tiles run M block by M block from the last (a causal head's longest rows) down, the section's heads
// next to each other in each. The last section may be narrower. Depends on static shapes only.
__device__ __forceinline__ CtaIndex IndexTile(const PrefillParams& p, int section_heads, int t) {
  const int heads = p.batch * p.kv_heads;
  const int section = t / (section_heads * p.m_blocks);  // section_heads <= heads: no overflow
  const int head0 = section * section_heads;
  const int width = min(section_heads, heads - head0);
  const int in_section = t - head0 * p.m_blocks;
  return {head0 + in_section % width, p.m_blocks - 1 - in_section / width, 0};
}

// What a tile's rows see: its batch row's clamped lengths, the variant of them and the CtaWork (the
// one-tile kernel's steps, PrefillKernel).
template <int kBlockM, int kBlockN, bool kSplit, class Variant>
struct TilePlan {
  int bh, q_len, kv_len;
  Variant var;
  CtaWork w;
  __device__ __forceinline__ TilePlan(const PrefillParams& p, const CtaIndex& idx)
      : bh(idx.bh),
        q_len(min(max(p.q_len[idx.bh / p.kv_heads], 0), p.q_rows)),
        kv_len(min(max(p.kv_len[idx.bh / p.kv_heads], 0), p.kv_rows)),
        var(p.variant, kv_len),
        w(PlanCta<kBlockM, kBlockN, kSplit>(p, var, idx.m_block, idx.split, q_len, kv_len)) {}
};

// The persistent kernel's body (PrefillKernel kPersistent, non-split): CTA c runs tiles c, c + grid,
// c + 2 grid, ... of IndexTile's order, each exactly as the one-tile kernel runs it (the same bits).
// What overlaps: the producer loads the next tile's Q into the other Q buffer and streams its first K /
// V tiles as soon as ring slots free, while the consumers finish this tile (the last P V, the
// epilogue); the barriers are initialised once. The i-th tile of a CTA uses Q buffer i % 2 (use
// i / 2 of it) and the ring from iteration it0 = the key tiles of the CTA's tiles before it; the
// producer and the consumers count both identically.
//   - q_full[b]: one arrival (the producer's, with the Q tile's bytes; a tile whose rows see no key
//     loads nothing and arrives plainly), one phase per use; the consumers wait for every tile, so
//     the phases stay in step whatever n_tiles is.
//   - q_empty[b]: kConsumers arrivals, one per consumer warpgroup once its epilogue's global stores
//     have read the rows it staged in the buffer; the producer waits for it before reusing the buffer
//     (use 0 passes at once: a fresh barrier's parity-1 wait).
//   - the ping-pong turns run round robin across the tiles (Consume kPersistent): warpgroup 0
//     issues tile i + 1's first Q K^T once the last warpgroup has issued tile i's last P V, while
//     that one still runs its epilogue. Tiles without keys take no turn.
template <typename T, int kD, class Variant, Schedule kSchedule, int kTune>
__device__ __forceinline__ void RunPersistent(const CUtensorMap& q_map, const CUtensorMap& k_map,
                                              const CUtensorMap& v_map, uint32_t base, uint8_t* base_ptr,
                                              const PrefillParams& p) {
  using L = Smem<kD, kTune, 2>;
  using Plan = TilePlan<L::kBlockM, L::kBlockN, false, Variant>;
  const int section_heads = PersistentSectionHeads(int64_t(p.batch) * p.kv_heads, p.kv_rows, kD, int(sizeof(T)));
  InitBarriers<L, 2>(base);

  const int tiles = p.batch * p.kv_heads * p.m_blocks;  // < 2^31: the handler checks
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    sm90::RegDealloc<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    sm90::PrefetchTensorMap(&q_map);
    sm90::PrefetchTensorMap(&k_map);
    sm90::PrefetchTensorMap(&v_map);
    int it0 = 0;
    for (int t = blockIdx.x, i = 0; t < tiles; t += gridDim.x, ++i) {
      const Plan plan(p, IndexTile(p, section_heads, t));
      const int b = i % 2;
      sm90::MbarWait(base + L::QEmpty(b), ((i / 2) & 1) ^ 1);
      const int n_tiles = plan.w.n_end - plan.w.n_begin;
      if (n_tiles > 0) {
        LoadTile<L>(q_map, k_map, v_map, base, plan.w, plan.bh, p, base + L::kQ + b * L::kQTileBytes,
                    base + L::QFull(b), it0);
      } else {
        sm90::MbarArrive(base + L::QFull(b));
      }
      it0 += n_tiles;
    }
  } else {
    sm90::RegAlloc<L::kConsumerRegisters>();
    const int cwg = wg - 1;
    // The CTA's first turn (Consume: the turns run on across tiles); taken back after the loop.
    if (cwg == L::kConsumers - 1) PassTurn<kSchedule, L::kConsumers>(cwg);
    int it0 = 0;
    for (int t = blockIdx.x, i = 0; t < tiles; t += gridDim.x, ++i) {
      const Plan plan(p, IndexTile(p, section_heads, t));
      const int b = i % 2;
      sm90::MbarWait(base + L::QFull(b), (i / 2) & 1);
      Consume<T, kD, Variant, kSchedule, kTune, false, true>(base, base_ptr, plan.w, plan.var, cwg, plan.bh, p,
                                                             b * L::kQTileBytes, it0);
      // The epilogue read its staged rows back (generic proxy) before the producer's next TMA (async
      // proxy) writes the buffer: fence, then the warpgroup's last reads, then one release.
      sm90::FenceProxyAsync();
      sm90::NamedBarrierSync(1 + cwg, 128);
      if (threadIdx.x % 128 == 0) sm90::MbarArrive(base + L::QEmpty(b));
      it0 += plan.w.n_end - plan.w.n_begin;
    }
    if (cwg == 0) TakeTurn<kSchedule, L::kConsumers>(cwg);  // the last warpgroup's last pass
  }
}

// kSplit: the split-KV kernel (p.splits > 1 CTAs per M block, SplitEpilogue; launch.cu runs it for
// the head size's default schedule only); without it the kernel is the one before split-KV,
// instruction for instruction.
// kPersistent: the persistent kernel (RunPersistent; not with kSplit, and only where the tiling holds
// two Q tiles, params.h PersistentFits).
template <typename T, int kD, class Variant, Schedule kSchedule, int kTune = kTuneNone, bool kSplit = false,
          bool kPersistent = false>
__global__ void __launch_bounds__(Smem<kD, kTune>::kThreads, 1)
    PrefillKernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                  const __grid_constant__ CUtensorMap v_map, const PrefillParams p) {
  static_assert(!(kSplit && kPersistent), "split-KV kernels are one tile a CTA");
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Smem<kD, kTune>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = ptx::SmemAddr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;  // the 128-byte swizzle repeats every 1024 bytes
  uint8_t* base_ptr = smem_raw + (base - raw);
  if constexpr (kPersistent) {
    RunPersistent<T, kD, Variant, kSchedule, kTune>(q_map, k_map, v_map, base, base_ptr, p);
    return;
  }

  // One linear grid, the M blocks of one (b, kvh) consecutive (FA3's order): the CTAs resident at
  // once share a few K / V heads, which stay in L2, instead of streaming one head each (B * Hkv
  // heads at once: 64 MB of K / V per wave at B * S = 16k, more than L2). Within a head the longest
  // causal rows first; split-KV kernels put the splits of an M block next to each other.
  const CtaIndex idx = IndexCta<kSplit>(p);
  const int bh = idx.bh;  // b * Hkv + kvh
  const int m_block = idx.m_block;
  const int b = bh / p.kv_heads;
  const int q_len = min(max(p.q_len[b], 0), p.q_rows);
  const int kv_len = min(max(p.kv_len[b], 0), p.kv_rows);
  const Variant var(p.variant, kv_len);
  const CtaWork w = PlanCta<L::kBlockM, L::kBlockN, kSplit>(p, var, m_block, idx.split, q_len, kv_len);

  InitBarriers<L, 1>(base);

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    sm90::RegDealloc<kProducerRegisters>();
    if (threadIdx.x == 0 && w.n_end > w.n_begin) Produce<T, kD, Variant, kTune>(q_map, k_map, v_map, base, w, bh, p);
  } else {
    sm90::RegAlloc<L::kConsumerRegisters>();
    Consume<T, kD, Variant, kSchedule, kTune, kSplit>(base, base_ptr, w, var, wg - 1, bh, p);
  }
#else
  // Built for a GPU without wgmma / TMA: the handler refuses to launch there.
  __trap();
#endif
}

}  // namespace joa::prefill
