// General attention for a few query rows on CUDA cores: the parameters and the static tiling.
//
// The path for every ai.onnx Attention call the tensor-core decode engine does not take: float32,
// V of another dtype or head size than Q, any head size, qk_matmul_output, a half-precision
// softmax. Rows are packed per KV head as in the engine: the G = Hq / Hkv query heads of KV head
// kvh and their S rows are packed row r = g * S + i, which is row bh * M + r (bh = b * Hkv + kvh,
// M = G * S) of q, y and the scores viewed as [B * Hq * S, ...].
#pragma once

#include <cstdint>

#include "kernels/common/params.h"

namespace joa::general {

// The dtype the softmax runs in, and its name for Python (jax_onnx_attn._ffi.limits(), indexed by
// the enum's value: ops/cuda.py passes the index of the dtype it wants).
enum class SoftmaxType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
inline constexpr const char* kSoftmaxTypeNames[] = {"float32", "float16", "bfloat16"};
// qk_matmul_output_mode values (the ONNX attribute), and kQkNone when no qk output is wanted.
inline constexpr int kQkNone = -1, kQkRaw = 0, kQkSoftcap = 1, kQkBiased = 2, kQkSoftmax = 3;

struct GeneralParams {
  // q [B, Hq, S, D] and k [B, Hkv, C, D] of one dtype; v [B, Hkv, C, Dv] of its own; y [B, Hq, S, Dv]
  // and qk [B, Hq, S, C] of q's dtype; scores f32 [B, Hq, S, C] (workspace). All dense.
  const void* q;
  const void* k;
  const void* v;
  void* y;
  void* qk;
  float* scores;
  const int32_t* kv_len;  // [B] valid rows per batch row, read on the device, clamped to [0, C]

  int batch, q_heads, kv_heads, q_len, capacity, head_dim, v_head_dim;
  int group;  // G = Hq / Hkv
  int rows;   // M = G * S packed rows per KV head

  // The variant (what a query row sees, how a logit becomes a score; no sinks here):
  // kernels/common/variant.cuh, as the decode engine reads it.
  VariantParams variant;

  int qk_mode;  // kQkNone or a qk_matmul_output_mode
  SoftmaxType softmax_type;
};

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;
// Packed query rows per CTA (both kernels); each thread owns kRowsPerThread of them.
inline constexpr int kRowsPerCta = 16;
inline constexpr int kRowsPerThread = 4;
// ScoresKernel: keys per CTA (one per thread column) and head-dim elements staged per step.
inline constexpr int kScoreKeys = kThreads * kRowsPerThread / kRowsPerCta;  // 64
inline constexpr int kChunkD = 64;
// SoftmaxValuesKernel: keys per V tile and value columns per CTA (kColThreads threads across, each
// with kColsPerThread columns).
inline constexpr int kValueKeys = 32;
inline constexpr int kColThreads = kThreads * kRowsPerThread / kRowsPerCta;  // 64
inline constexpr int kColsPerThread = 4;
inline constexpr int kValueCols = kColThreads * kColsPerThread;  // 256

// Launch geometry, from static shapes only (constexpr: the kernels use them too).
constexpr int64_t RowBlocks(int64_t rows) { return (rows + kRowsPerCta - 1) / kRowsPerCta; }
constexpr int64_t KeyTiles(int64_t capacity) { return (capacity + kScoreKeys - 1) / kScoreKeys; }
// Most keys a call may have: ScoresKernel's key tiles are a grid dimension (at most 65535).
inline constexpr int64_t kMaxKeys = int64_t(kScoreKeys) * 65535;
// At least one column block: the mode-3 qk output is written there even when Dv is 0.
constexpr int64_t ColumnBlocks(int64_t v_head_dim) {
  return v_head_dim > 0 ? (v_head_dim + kValueCols - 1) / kValueCols : 1;
}

}  // namespace joa::general
