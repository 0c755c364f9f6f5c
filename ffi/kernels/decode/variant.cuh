// Decode attention variants: the op-specific part of the engine, as policy types.
//
// The engine asks a variant three things: which key range the CTA's query rows can see at all
// (Bounds, so tiles outside it are never read), whether one key is visible to one row (Visible,
// evaluated only on tiles that are not fully visible), and how a raw q.k becomes a score in the log2
// domain (Score, evaluated only on visible keys, so a bias is never read out of its bounds).
//
// MaskVariant: valid length, bottom-right causal offset, local window. Enough for most decode
//   steps; its score is one multiply.
// LogitVariant: MaskVariant plus softcap and an additive / boolean bias.
// Sinks (extra softmax logits without a value row) do not touch the per-key path: the engine's
// epilogue or the combine applies them.
#pragma once

#include <cstdint>

#include "kernels/decode/params.h"

namespace joa::decode {

inline constexpr float kLog2e = 1.4426950408889634f;

// What one packed query row needs to judge its keys.
struct QueryRow {
  int pos;           // absolute position of the query row: kv_len - S + i
  int64_t bias_off;  // element offset of bias[b, h, i, 0]
};

// [lo, hi): keys some row of the CTA may see; [full_lo, full_hi): keys every row sees.
struct KeyBounds {
  int lo, hi, full_lo, full_hi;
};

class MaskVariant {
 public:
  __device__ MaskVariant(const DecodeParams& p, int len)
      : len_(p.bias ? min(len, p.bias_len) : len),
        causal_(p.causal),
        left_(p.left),
        right_(p.right),
        scale_log2_(p.scale * kLog2e) {}

  // pos_min / pos_max: the smallest and largest query position of the CTA.
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

  __device__ bool Visible(const QueryRow& row, int j) const {
    return j < len_ && (!causal_ || j <= row.pos) && (left_ < 0 || row.pos - j <= left_) &&
           (right_ < 0 || j - row.pos <= right_);
  }

  __device__ float Score(float qk, const QueryRow&, int) const { return qk * scale_log2_; }

 protected:
  int len_;
  bool causal_;
  int left_, right_;
  float scale_log2_;
};

class LogitVariant : public MaskVariant {
 public:
  __device__ LogitVariant(const DecodeParams& p, int len)
      : MaskVariant(p, len),
        scale_(p.scale),
        softcap_(p.softcap),
        inv_softcap_(p.softcap > 0.f ? 1.f / p.softcap : 0.f),
        bias_(p.bias),
        bias_type_(p.bias_type) {}

  __device__ float Score(float qk, const QueryRow& row, int j) const {
    float x = qk * scale_;
    // tanhf, not tanh.approx: its 2^-11 error times a softcap of ~30-50 would move fp16 results.
    if (softcap_ > 0.f) x = softcap_ * tanhf(x * inv_softcap_);
    if (bias_type_ != BiasType::kNone) x += BiasValue(bias_, bias_type_, row.bias_off + j);
    return x * kLog2e;
  }

 private:
  float scale_, softcap_, inv_softcap_;
  const void* bias_;
  BiasType bias_type_;
};

}  // namespace joa::decode
