// Split-KV decode attention: the parameters every launch takes, and the static tiling.
//
// One engine serves both operators. A launch attends query rows q[b, h, i] (i < S <= 16 typically)
// to the first kv_len[b] rows of a fixed-capacity cache k/v[b, h / G, :, :]. The G query heads of a
// KV head and their S rows are packed into the M dimension (row r = g * S + i), so a CTA reads each
// KV row once for all of them. The context is cut into splits of a fixed size (a multiple of the KV
// tile, chosen from static shapes by plan.h); each split writes a partial output and its
// log-sum-exp, and a combine kernel merges the splits in a fixed order.
#pragma once

#include <cstdint>

#include "kernels/common/params.h"

namespace joa::decode {

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
  // > 1: the splits of a (b, KV head, M block) run as one thread-block cluster of this many CTAs
  // and combine through distributed shared memory (cluster_combine.cuh); no workspace, no combine
  // kernel. Set by the launcher only where the device and the engine layout allow it.
  int cluster;
  float* part_o;
  float* part_lse;

  // The variant (what a query row sees, how a logit becomes a score): kernels/common/variant.cuh.
  VariantParams variant;

  // A quantized cache (kv_format != kDense) has its K / V strides in bytes; a value is
  // q * scale (f32, a scale of 0 read as 1; kernels/common/kv_quant.cuh).
  KvFormat kv_format;
  KvScales kv_scales;
};

// Host-side launch choices that are not kernel parameters.
struct LaunchOptions {
  bool logit_variant;  // softcap or bias present: LogitVariant, else MaskVariant
  bool pdl;            // launch the combine as a programmatic dependent of the split kernel
  // An int8 / int4 cache dequantised in registers (DecodeSplitKernelQRegs, engine_qregs.cuh)
  // instead of converted tile by tile in shared memory; ignored for a dense cache.
  bool quant_regs = false;
  // A dense cache copied through per-thread row cursors (DenseCursorKv, kv_format.cuh) where its
  // rows are contiguous; the same bits as without. Ignored for a quantised cache.
  bool cursor_loads = false;
  // A dense cache copied by a producer warp with bulk copies into an mbarrier ring (DenseProducerKv,
  // kv_format.cuh); the same bits as without. sm_90 only: the handler clears it on other GPUs.
  // Ignored for a quantised cache; takes precedence over cursor_loads.
  bool producer = false;
  // The wide KV tile (plan.h kWideTileN rows a stage, WideTileKv): a float cache's 16-row blocks at
  // the head dims of kWideTileHeadDims whose splits are whole wide tiles (MakePlan's rule, which
  // sizes them so); with the cursor loads where those apply. Not the same bits as the default tile
  // (one softmax update a 128 rows). Ignored elsewhere, and where the producer warp runs.
  bool tile128 = false;
  // With quant_regs, blocks of at most 8 query rows in one warp row (key_rows.cuh kKeyRowsMaxRows)
  // take the register kernel's key-rows form (DecodeSplitKernelQRegs<..., true>): keys in the MMAs'
  // rows, half the MMAs and score work. Not the query-rows form's bits (the sums add in another
  // order). Ignored elsewhere.
  bool key_rows = false;
};

}  // namespace joa::decode
