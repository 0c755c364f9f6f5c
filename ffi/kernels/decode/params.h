// Split-KV decode attention: the parameters every launch takes, and the static tiling.
//
// One engine serves both operators. A launch attends query rows q[b, h, i] (i < S <= 16 typically)
// to the first kv_len[b] rows of a fixed-capacity cache k/v[b, h / G, :, :]. The G query heads of a
// KV head and their S rows are packed into the M dimension (row r = g * S + i), so a CTA reads each
// KV row once for all of them. The context is cut into splits of a fixed size (a multiple of the KV
// tile, chosen from static shapes by the caller); each split writes a partial output and its
// log-sum-exp, and a combine kernel merges the splits in a fixed order.
#pragma once

#include <cstdint>

namespace joa::decode {

// Split sizes are multiples of this many KV rows (and so of every engine tile size).
inline constexpr int kBlockN = 64;

enum class BiasType : int { kNone = 0, kF32 = 1, kF16 = 2, kBF16 = 3, kBool = 4 };

struct DecodeParams {
  // q [B, Hq, S, D] and out [B, Hq, S, D]; k, v [B, Hkv, C, D]. Strides in elements; the last dim
  // is contiguous.
  const void* q;
  const void* k;
  const void* v;
  void* out;
  int64_t q_stride_b, q_stride_h, q_stride_s;
  int64_t o_stride_b, o_stride_h, o_stride_s;
  int64_t k_stride_b, k_stride_h, k_stride_n;
  int64_t v_stride_b, v_stride_h, v_stride_n;
  const int32_t* kv_len;  // [B] valid rows per batch row, read on the device, clamped to [0, C]

  int batch, q_heads, kv_heads, q_len, capacity;
  int group;     // G = Hq / Hkv
  int rows;      // M = G * S, packed query rows per KV head
  int m_blocks;  // ceil(M / block_m) CTAs along M per KV head

  // Split-KV: split s covers KV rows [s * split_rows, (s + 1) * split_rows). With one split the
  // engine normalises and writes `out` itself; otherwise partials go to the workspace:
  // part_o f32 [B, Hkv, splits, M, D] (normalised per split), part_lse f32 [B, Hkv, splits, M]
  // (log2 domain; -inf for a split that saw no key).
  int splits, split_rows;
  float* part_o;
  float* part_lse;

  // The variant (what a query row sees, how a logit becomes a score); see variant.cuh.
  float scale;    // multiplies q.k
  float softcap;  // > 0: softcap * tanh(x / softcap), before the bias
  bool causal;    // key j visible to row i only if j <= pos_i = kv_len - S + i + pos_shift
  int pos_shift;  // static shift of every query position (0: bottom-right aligned at kv_len)
  int left;       // >= 0: keys with pos_i - j > left are hidden
  int right;      // >= 0: keys with j - pos_i > right are hidden
  // Additive bias bias[b, h, i, j] (bool: true = keep, false = -inf), indexed by absolute key j;
  // keys j >= bias_len are hidden. Strides are 0 along broadcast dims.
  const void* bias;
  BiasType bias_type;
  int64_t bias_stride_b, bias_stride_h, bias_stride_s;
  int bias_len;
  // Per query head extra logit (natural units) in the softmax denominator, no value row.
  const float* sink;
};

// Host-side launch choices that are not kernel parameters.
struct LaunchOptions {
  bool logit_variant;  // softcap or bias present: LogitVariant, else MaskVariant
  bool pdl;            // launch the combine as a programmatic dependent of the split kernel
};

}  // namespace joa::decode
