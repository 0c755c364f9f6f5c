// The epilogue policies: what happens to the reduced f32 sums of a row block before they are stored.
// Each writes units of 8 consecutive outputs of one x row (one 16-byte store); `get(r0, v)` fills
// v with the sums of the block's local W rows r0 .. r0 + 7. The roundings are those of the unfused
// graph (MatMul, then Add, then Add; jax_onnx_attn.ops.reference.linear).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/status.h"
#include "kernels/common/rotary.cuh"
#include "kernels/convert.cuh"
#include "kernels/gemv/params.h"
#include "kernels/gemv/stage.cuh"

namespace joa::gemv {

// y = round(round(round(x W^T) + bias) + residual), bias and residual optional (null pointers).
struct StoreEpilogue {
  static constexpr bool kGated = false;
  __host__ __device__ static constexpr int OutCols(int rows_block) { return rows_block; }

  template <typename T, class Get>
  __device__ __forceinline__ static void Apply(const GemvParams& p, int m, int block, int oc, Get&& get) {
    const int n0 = block * p.rows_block + oc;  // output column = W row
    if (n0 >= p.n_out) return;
    float v[8];
    get(oc, v);
    Vec8<T> out;
#pragma unroll
    for (int i = 0; i < 8; ++i) out.v[i] = FromFloat<T>(v[i]);
    if (p.bias != nullptr) {
      const Vec8<T> b = AsVec8<T>(LoadInput16(static_cast<const T*>(p.bias) + n0));
#pragma unroll
      for (int i = 0; i < 8; ++i) out.v[i] = FromFloat<T>(ToFloat(out.v[i]) + ToFloat(b.v[i]));
    }
    const int64_t at = int64_t(m) * p.n_out + n0;
    if (p.residual != nullptr) {
      const Vec8<T> r = AsVec8<T>(LoadInput16(static_cast<const T*>(p.residual) + at));
#pragma unroll
      for (int i = 0; i < 8; ++i) out.v[i] = FromFloat<T>(ToFloat(out.v[i]) + ToFloat(r.v[i]));
    }
    *reinterpret_cast<uint4*>(static_cast<T*>(p.y) + at) = AsUint4(out);
  }
};

// W rows interleaved gate / up in blocks of 8 (jax_onnx_attn.ops.linear.interleave_gate_up): a
// 16-row tile is gate rows 8b .. 8b+7 then up rows 8b .. 8b+7, and gives outputs 8b .. 8b+7:
// y = round(silu(g) * u) in f32 from g, u = the rounded products (+ bias, rounded), then
// + residual (rounded) if any.
struct GatedSiluEpilogue {
  static constexpr bool kGated = true;
  __host__ __device__ static constexpr int OutCols(int rows_block) { return rows_block / 2; }

  template <typename T, class Get>
  __device__ __forceinline__ static void Apply(const GemvParams& p, int m, int block, int oc, Get&& get) {
    const int o0 = block * (p.rows_block / 2) + oc;
    if (o0 >= p.n_out) return;
    const int lr = 2 * oc;  // local gate rows lr .. lr + 7, up rows lr + 8 .. lr + 15
    float vg[8], vu[8];
    get(lr, vg);
    get(lr + 8, vu);
    Vec8<T> gate, up;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      gate.v[i] = FromFloat<T>(vg[i]);
      up.v[i] = FromFloat<T>(vu[i]);
    }
    if (p.bias != nullptr) {
      const T* bias = static_cast<const T*>(p.bias) + int64_t(block) * p.rows_block + lr;
      const Vec8<T> bg = AsVec8<T>(LoadInput16(bias));
      const Vec8<T> bu = AsVec8<T>(LoadInput16(bias + 8));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        gate.v[i] = FromFloat<T>(ToFloat(gate.v[i]) + ToFloat(bg.v[i]));
        up.v[i] = FromFloat<T>(ToFloat(up.v[i]) + ToFloat(bu.v[i]));
      }
    }
    Vec8<T> out;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float g = ToFloat(gate.v[i]);
      out.v[i] = FromFloat<T>(__fmul_rn(__fdiv_rn(g, 1.f + expf(-g)), ToFloat(up.v[i])));
    }
    const int64_t at = int64_t(m) * p.n_out + o0;
    if (p.residual != nullptr) {
      const Vec8<T> r = AsVec8<T>(LoadInput16(static_cast<const T*>(p.residual) + at));
#pragma unroll
      for (int i = 0; i < 8; ++i) out.v[i] = FromFloat<T>(ToFloat(out.v[i]) + ToFloat(r.v[i]));
    }
    *reinterpret_cast<uint4*>(static_cast<T*>(p.y) + at) = AsUint4(out);
  }
};

// The packed Q | K | V projection of a GroupQueryAttention decode step finished as the op's step
// preparation (float cache, no q / k norm; p.qkv): what gqa_prepare (kernels/gqa/prepare.cuh) does
// with the projection's output, without writing it. W's rows are in the rotary-pair order
// (jax_onnx_attn.ops.linear.rotary_pair_order): in a Q or K head, the 16-row group j < R / 16 holds
// dims 8j .. 8j+7 then their rotary partners R/2 + 8j ..; the rest of the head and the V heads in
// order. A group gives 16 outputs: round(x W^T) (+ bias, rounded), as StoreEpilogue, then for a
// rotary group the rotation at the row's position (kernels/common/rotary.cuh, gqa_prepare's bits),
// stored to q_out [B, N, S, D] (Q) or to cache row past_b + s (K, V). A batch row whose rows do not
// fit the cache writes no K / V; the group at W row 0 writes its status, as gqa_prepare.
struct QkvRotaryEpilogue {
  static constexpr bool kGated = false;
  // One Apply per 16 W rows (the gated epilogue's unit).
  __host__ __device__ static constexpr int OutCols(int rows_block) { return rows_block / 2; }

  // What every group of x row m reads besides its sums: the row's cache slot and position.
  struct Row {
    int32_t past;  // the cache row of s = 0 (int32 wrap-around, as gqa_prepare: the spec's jnp arithmetic)
    int32_t pos;   // the rotary position, clipped as the spec's gather clips
    bool fits;     // the row's K / V fit the cache
  };
  __device__ __forceinline__ static Row ReadRow(const GemvParams& p, int m) {
    const QkvRotaryParams& q = p.qkv;
    const int b = m / q.seq, s = m - b * q.seq;
    Row r;
    r.past = int32_t(uint32_t(q.seqlens[b]) + 1u - uint32_t(q.seq));
    r.fits = r.past >= 0 && r.past <= q.capacity - q.seq;
    const int32_t pos = q.position_ids != nullptr ? q.position_ids[m] : int32_t(uint32_t(r.past) + uint32_t(s));
    r.pos = min(max(pos, 0), q.max_position - 1);
    return r;
  }

  // Whether the group at W row n0 is rotated; if so its first dim pair d_lo (dims d_lo .. d_lo + 7
  // and their partners R/2 + d_lo ..).
  __device__ __forceinline__ static bool RotaryGroup(const GemvParams& p, int n0, int& d_lo) {
    const QkvRotaryParams& q = p.qkv;
    const int head = n0 / q.head_dim, within = n0 - head * q.head_dim;
    if (head >= q.heads + q.kv_heads || within >= 2 * q.rotary_half) return false;  // V, or past R
    d_lo = within / 2;  // group j = within / 16: dims 8j and R/2 + 8j
    return true;
  }

  // The offset of the cos / sin of the row's position for dims d_lo .. d_lo + 7 in their tables.
  __device__ __forceinline__ static int64_t Angle(const GemvParams& p, const Row& r, int d_lo) {
    return int64_t(r.pos) * p.qkv.rotary_half + d_lo;
  }

  template <typename T, class Get>
  __device__ __forceinline__ static void Apply(const GemvParams& p, int m, int block, int oc, Get&& get) {
    ApplyRow<T>(p, m, block, oc, ReadRow(p, m), get);
  }

  // Apply with the row already read.
  template <typename T, class Get>
  __device__ __forceinline__ static void ApplyRow(const GemvParams& p, int m, int block, int oc, const Row& r,
                                                  Get&& get) {
    const int lr = 2 * oc;
    const int n0 = block * p.rows_block + lr;  // the group's first W row
    if (n0 >= p.n_rows) return;
    const QkvRotaryParams& q = p.qkv;
    float lo[8], hi[8];
    get(lr, lo);
    get(lr + 8, hi);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      lo[i] = RoundTo<T>(lo[i]);
      hi[i] = RoundTo<T>(hi[i]);
    }
    if (p.bias != nullptr) {
      const Vec8<T> bl = AsVec8<T>(LoadInput16(static_cast<const T*>(p.bias) + n0));
      const Vec8<T> bh = AsVec8<T>(LoadInput16(static_cast<const T*>(p.bias) + n0 + 8));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        lo[i] = RoundTo<T>(lo[i] + ToFloat(bl.v[i]));
        hi[i] = RoundTo<T>(hi[i] + ToFloat(bh.v[i]));
      }
    }
    const int d = q.head_dim;
    const int head = n0 / d, within = n0 - head * d;
    const int b = m / q.seq, s = m - b * q.seq;
    if (n0 == 0 && s == 0) q.status[b] = r.fits ? status::kOk : status::kKvWriteOutOfRange;
    const bool is_q = head < q.heads;
    const bool is_v = head >= q.heads + q.kv_heads;
    if (!is_q && !r.fits) return;
    int d_lo = within, d_hi = within + 8;
    if (RotaryGroup(p, n0, d_lo)) {
      d_hi = q.rotary_half + d_lo;
      const int64_t angle = Angle(p, r, d_lo);
      const Vec8<T> cv = AsVec8<T>(LoadInput16(static_cast<const T*>(q.cos) + angle));
      const Vec8<T> sv = AsVec8<T>(LoadInput16(static_cast<const T*>(q.sin) + angle));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float c = ToFloat(cv.v[i]), sn = ToFloat(sv.v[i]);
        const float x1 = lo[i], x2 = hi[i];
        lo[i] = RotaryFirst<T>(x1, x2, c, sn);
        hi[i] = RotarySecond<T>(x1, x2, c, sn);
      }
    }
    T* row;
    if (is_q) {
      row = static_cast<T*>(q.q_out) + ((int64_t(b) * q.heads + head) * q.seq + s) * d;
    } else {
      const int kv_head = is_v ? head - q.heads - q.kv_heads : head - q.heads;
      row = static_cast<T*>(is_v ? q.v_cache : q.k_cache) +
            ((int64_t(b) * q.kv_heads + kv_head) * q.capacity + r.past + s) * d;
    }
    Vec8<T> out_lo, out_hi;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out_lo.v[i] = FromFloat<T>(lo[i]);
      out_hi.v[i] = FromFloat<T>(hi[i]);
    }
    *reinterpret_cast<uint4*>(row + d_lo) = AsUint4(out_lo);
    *reinterpret_cast<uint4*>(row + d_hi) = AsUint4(out_hi);
  }
};

// What a one-row kernel's epilogue thread reads once, before the CTA's first tile (after the
// programmatic wait: it may come from the previous kernel), so that no tile's end waits on it:
// nothing, but for the fused QKV epilogue (below).
template <typename T, class Epilogue>
struct OneRowAhead {
  __device__ __forceinline__ static OneRowAhead Read(const GemvParams&, int /*first_tile*/) { return {}; }
  template <class Get>
  __device__ __forceinline__ void Apply(const GemvParams& p, int tile, int oc, Get&& get) const {
    Epilogue::template Apply<T>(p, 0, tile, oc, get);
  }
};

// The fused QKV epilogue read its row's slot, then (dependent) the cos / sin at the tile's end: two
// L2 round trips after the last chunk, ~0.9 us a call over the plain projection (H200, session 34's
// `bench breakdown`). Read ahead: the row (three registers), and the cos / sin lines of the CTA's
// first tile prefetched into L1 (no registers: the norm prologue's dense-row kernel is at its 128
// cap; both one-row kernels stream W past L1, so the lines stay), so the tile's end reads them from
// L1. A grid covers most tiles once (~1B qkv 192 tiles, ~8B 384, up to 264 CTAs). Session 36
// (H100, B=1, ms a step fused / unfused): ~1B fp16 1.223 / 1.243, int4 0.680 / 0.778, ~8B 5.844 / 5.924.
template <typename T>
struct OneRowAhead<T, QkvRotaryEpilogue> {
  QkvRotaryEpilogue::Row row;

  __device__ __forceinline__ static OneRowAhead Read(const GemvParams& p, int first_tile) {
    OneRowAhead a;
    a.row = QkvRotaryEpilogue::ReadRow(p, 0);
    const int n0 = first_tile * p.rows_block;
    int d_lo;
    if (n0 < p.n_rows && QkvRotaryEpilogue::RotaryGroup(p, n0, d_lo)) {
      const int64_t angle = QkvRotaryEpilogue::Angle(p, a.row, d_lo);
      PrefetchL1(static_cast<const T*>(p.qkv.cos) + angle);
      PrefetchL1(static_cast<const T*>(p.qkv.sin) + angle);
    }
    return a;
  }
  template <class Get>
  __device__ __forceinline__ void Apply(const GemvParams& p, int tile, int oc, Get&& get) const {
    QkvRotaryEpilogue::ApplyRow<T>(p, 0, tile, oc, row, get);
  }
};

// The one-row kernels' end of a 16-row tile, after a CTA barrier: red[w * stride + r] holds warp
// w's partial sum of the tile's row r; threads 0-15 (warp 0) add the warps in order into warp 0's
// slot, then the epilogue's threads store the tile's outputs. Deterministic (fixed order).
template <typename T, class Epilogue>
__device__ __forceinline__ void OneRowTileEpilogue(const GemvParams& p, int tile, float* red, int stride, int tid,
                                                   const OneRowAhead<T, Epilogue>& ahead) {
  if (tid >= 16) return;
  float v = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) v += red[w * stride + tid];
  red[tid] = v;
  __syncwarp(0xFFFFu);
  if (tid < Epilogue::OutCols(16) / 8) {
    ahead.Apply(p, tile, tid * 8, [&](int r0, float (&v8)[8]) {
#pragma unroll
      for (int e = 0; e < 8; ++e) v8[e] = red[r0 + e];
    });
  }
}

}  // namespace joa::gemv
