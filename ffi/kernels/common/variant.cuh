// Attention variants: the op-specific part of every engine (the decode engine, the general kernel,
// the prefill engine to come), as policy types constructed from what they read (VariantParams,
// params.h) and the row's valid length.
//
// An engine asks a variant which key range its query rows can see at all (Bounds, so tiles outside
// it are never read), whether one key is visible to one row (Visible), and how a raw q.k becomes a
// logit: Scaled (x scale), Capped (softcap), Biased (+ bias), in natural units for engines that
// need those stages (the general kernel's qk outputs), or Score: all of them in the log2 domain for
// engines that exponentiate with exp2 (evaluated only on visible keys, so a bias is never read out
// of its bounds).
//
// MaskVariant: valid length (and the bias length), causal with pos_shift, windows left / right.
//   Enough for most decode steps; its Score is one multiply.
// LogitVariant: MaskVariant plus softcap and an additive / boolean bias.
// CapVariant: MaskVariant plus softcap (no bias), for engines with a kernel per variant.
// Sinks (extra softmax logits without a value row) do not touch the per-key path: an engine's
// epilogue or combine adds SinkLog2 once.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common/bias.cuh"
#include "kernels/common/params.h"

namespace joa {

inline constexpr float kLog2e = 1.4426950408889634f;

// What one query row needs to judge its keys. Pos: the position's type (int where the engine keeps
// positions in 32 bits, int64_t where a large pos_shift must not wrap).
template <typename Pos = int>
struct QueryRow {
  Pos pos;           // absolute position of the query row: kv_len - S + i + pos_shift
  int64_t bias_off;  // element offset of bias[b, h, i, 0]
};

// [lo, hi): keys some row of a block may see; [full_lo, full_hi): keys every row sees.
struct KeyBounds {
  int lo, hi, full_lo, full_hi;
};

class MaskVariant {
 public:
  // len: the batch row's valid keys (kv_len clamped to the capacity).
  __device__ MaskVariant(const VariantParams& v, int len)
      : len_(v.bias ? min(len, v.bias_len) : len),
        causal_(v.causal),
        left_(v.left),
        right_(v.right),
        scale_log2_(v.scale * kLog2e) {}

  // Whether Score is qk times ScoreScale() and nothing else: an engine that multiplies qk by a
  // factor of its own first (a dequantisation scale) may fold the two into one multiply. Every
  // subclass says again (it does not inherit the answer).
  static constexpr bool kScoreIsScale = true;
  __device__ float ScoreScale() const { return scale_log2_; }

  // pos_min / pos_max: the smallest and largest query position of the block.
  __device__ KeyBounds Bounds(int pos_min, int pos_max) const {
    KeyBounds k{0, len_, 0, len_};
    if (causal_) {
      k.hi = min(k.hi, pos_max + 1);
      k.full_hi = min(k.full_hi, pos_min + 1);
    }
    if (right_ >= 0) {
      k.hi = min(k.hi, pos_max + right_ + 1);
      k.full_hi = min(k.full_hi, pos_min + right_ + 1);
    }
    if (left_ >= 0) {
      k.lo = max(0, pos_min - left_);
      k.full_lo = max(0, pos_max - left_);
    }
    return k;
  }

  template <typename Pos>
  __device__ bool Visible(const QueryRow<Pos>& row, int j) const {
    return j < len_ && (!causal_ || j <= row.pos) && (left_ < 0 || row.pos - j <= left_) &&
           (right_ < 0 || j - row.pos <= right_);
  }

  template <typename Pos>
  __device__ float Score(float qk, const QueryRow<Pos>&, int) const { return qk * scale_log2_; }

 protected:
  int len_;
  bool causal_;
  int left_, right_;
  float scale_log2_;
};

class LogitVariant : public MaskVariant {
 public:
  __device__ LogitVariant(const VariantParams& v, int len)
      : MaskVariant(v, len),
        scale_(v.scale),
        softcap_(v.softcap),
        inv_softcap_(v.softcap > 0.f ? 1.f / v.softcap : 0.f),
        bias_(v.bias),
        bias_type_(v.bias_type) {}

  static constexpr bool kScoreIsScale = false;

  __device__ float Scaled(float qk) const { return qk * scale_; }

  // tanhf, not tanh.approx: its 2^-11 error times a softcap of ~30-50 would move fp16 results.
  __device__ float Capped(float x) const { return softcap_ > 0.f ? softcap_ * tanhf(x * inv_softcap_) : x; }

  template <typename Pos>
  __device__ float Biased(float x, const QueryRow<Pos>& row, int j) const {
    return bias_type_ != BiasType::kNone ? x + BiasValue(bias_, bias_type_, row.bias_off + j) : x;
  }

  template <typename Pos>
  __device__ float Score(float qk, const QueryRow<Pos>& row, int j) const {
    return Biased(Capped(Scaled(qk)), row, j) * kLog2e;
  }

 private:
  float scale_, softcap_, inv_softcap_;
  const void* bias_;
  BiasType bias_type_;
};

// MaskVariant plus softcap only (softcap > 0 assumed): LogitVariant's Scaled -> Capped without its
// bias, for engines that instantiate a kernel per variant (the prefill engine) so that kernels
// without softcap keep MaskVariant's one-multiply Score. Same arithmetic as LogitVariant's.
class CapVariant : public MaskVariant {
 public:
  __device__ CapVariant(const VariantParams& v, int len)
      : MaskVariant(v, len), scale_(v.scale), softcap_(v.softcap), inv_softcap_(1.f / v.softcap) {}

  static constexpr bool kScoreIsScale = false;

  // tanhf, not tanh.approx (LogitVariant's rule).
  template <typename Pos>
  __device__ float Score(float qk, const QueryRow<Pos>&, int) const {
    return softcap_ * tanhf(qk * scale_ * inv_softcap_) * kLog2e;
  }

 private:
  float scale_, softcap_, inv_softcap_;
};

// Query head h's sink in the log2 domain, or -inf without sinks (or where this step does not add
// it: `here` false): enters the softmax's max and denominator once (one split's epilogue or the
// combine), never the per-key path.
__device__ __forceinline__ float SinkLog2(const float* sink, int h, bool here = true) {
  return (here && sink) ? sink[h] * kLog2e : -INFINITY;
}

}  // namespace joa
