// What every attention engine reads to decide which keys a query row sees and how a logit becomes a
// score (the variant), and how a KV cache is stored (the format). Plain C++: the handlers fill these
// on the host, the policies of variant.cuh / kv_quant.cuh read them on the device.
#pragma once

#include <cstdint>

namespace joa {

// An attention bias: an additive float (f32 / f16 / bf16) or a boolean keep-mask (bias.cuh reads it).
enum class BiasType : int { kNone = 0, kF32 = 1, kF16 = 2, kBF16 = 3, kBool = 4 };

// The variant of one attention call: static attributes and the bias / sink buffers. Query row i of
// batch row b sits at position pos_i = kv_len[b] - S + i + pos_shift; keys are absolute rows j.
struct VariantParams {
  float scale;    // multiplies q.k
  float softcap;  // > 0: softcap * tanh(x / softcap), before the bias
  bool causal;    // key j visible to row i only if j <= pos_i
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

// How a KV cache stores its values (kv_quant.cuh has the one layout of the quantised formats).
enum class KvFormat : int { kDense = 0, kInt8 = 1, kInt4 = 2 };

// Bits per stored value of a quantised format (0 for a dense cache of the query's type).
constexpr int KvBits(KvFormat f) { return f == KvFormat::kInt8 ? 8 : f == KvFormat::kInt4 ? 4 : 0; }

// Elements of a cache row of d values: d for a dense cache, d * bits / 8 bytes when quantised.
constexpr int64_t KvRowElems(int64_t d, KvFormat f) { return f == KvFormat::kDense ? d : d * KvBits(f) / 8; }

// Where logical 16-byte chunk `chunk` of row `row` of a K / V tile in shared memory lives: with
// `swizzle` (rows of whole 128-byte lines: the decode engine's Layout::swizzle) the chunks of a row
// are XOR-ed with row % 8, so the 8 rows an ldmatrix reads at one chunk land in 8 different 16-byte
// bank groups and each 32-byte sector a copy brings stays in one 32-byte unit; else unchanged (rows
// padded by 16 bytes do the first). The one definition: the engine's copies and reads, the
// quantised tiles' conversion (kv_format.cuh) and tests/test_decode_tile_swizzle.py.
constexpr int TileChunk(bool swizzle, int row, int chunk) { return swizzle ? chunk ^ (row & 7) : chunk; }
// The element offset of that chunk in a tile whose rows are `stride` elements apart.
constexpr int TileElem(bool swizzle, int stride, int row, int chunk) {
  return row * stride + 8 * TileChunk(swizzle, row, chunk);
}

// The f32 dequantisation scales of a quantised cache: one element, or [Hkv, D] when *_per_channel.
struct KvScales {
  const float* k;
  const float* v;
  bool k_per_channel, v_per_channel;
};

}  // namespace joa
