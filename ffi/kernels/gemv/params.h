// What a GEMV launch passes to the kernel: pointers, the static shape and the plan (plan.h).
#pragma once

#include <cstdint>

namespace joa::gemv {

// QkvRotaryEpilogue's operands (epilogue.cuh): the packed Q | K | V projection of one decode step
// (x row m = b * seq + s) finished as GroupQueryAttention's step preparation, for a float cache.
// W's rows are in the rotary-pair order (jax_onnx_attn.ops.linear.rotary_pair_order).
struct QkvRotaryParams {
  const void* cos;               // [max_position, rotary_half] T
  const void* sin;
  const int32_t* seqlens;        // [batch]: past_b = seqlens[b] + 1 - seq
  const int32_t* position_ids;   // [batch, seq] or null (positions past_b + s)
  void* q_out;                   // [batch, heads, seq, head_dim] T
  void* k_cache;                 // [batch, kv_heads, capacity, head_dim] T (written in place)
  void* v_cache;
  int32_t* status;               // [batch]
  int seq, heads, kv_heads, head_dim, capacity, rotary_half, max_position;
};

struct GemvParams {
  const void* x;         // [m, k] T
  const void* w;         // dense: [n_rows, k] T; n-bit: uint8 [n_rows, k * bits / 8]
  const void* scales;    // n-bit: [ceil(n_rows / 16), k_blocks, 16] T (plan.h's kMetaTileRows)
  const uint8_t* zeros;  // n-bit: uint8, scales' shape, or null (2^(bits-1))
  const void* bias;      // [n_rows] T or null
  const void* residual;  // [m, n_out] T or null
  const void* gamma;     // [k] T (RMS norm prologue) or null
  void* y;               // [m, n_out] T
  float eps;
  int m, n_rows, n_out, k;
  int k_blocks, block_shift;  // n-bit: k / block_size and log2(block_size)
  // The plan (MakePlan): chunks, warp layout, cluster, persistent row blocks.
  int kc, cpp, stages, slice_chunks;
  int cluster, warps_n, warps_k, rows_block, blocks, groups, red_stride;
  int x_bytes, red_bytes, gamma_offset, ring_offset;  // smem: x | reductions | norm | gamma | rings
  int x_first;  // not a programmatic dependent launch: x's copy group goes before the ring's
  QkvRotaryParams qkv;  // QkvRotaryEpilogue only
};

}  // namespace joa::gemv
