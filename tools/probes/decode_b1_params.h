// Shared by the decode probes (decode_last_cta.cu, decode_raw_on_jax.cu): the DecodeParams of a B=1
// decode call, 32/8 heads, head dim 128, q_len 1, a full cache of `ctx` rows split in `split_rows`
// (the handler's Configure for that shape; pointers, kv_len and the workspace are the caller's).
#pragma once

#include <cstdint>

#include "common/variant.h"
#include "kernels/decode/params.h"

inline joa::decode::DecodeParams B1DecodeParams(int ctx, int split_rows, int hq = 32, int hkv = 8, int d = 128) {
  joa::decode::DecodeParams p{};
  p.batch = 1; p.q_heads = hq; p.kv_heads = hkv; p.q_len = 1; p.capacity = ctx; p.group = hq / hkv;
  p.rows = hq / hkv; p.splits = (ctx + split_rows - 1) / split_rows; p.split_rows = split_rows;
  p.q_stride_s = p.o_stride_s = d; p.q_stride_h = p.o_stride_h = d; p.q_stride_b = p.o_stride_b = hq * d;
  p.k_stride_n = p.v_stride_n = d; p.k_stride_h = p.v_stride_h = int64_t(ctx) * d;
  p.k_stride_b = p.v_stride_b = int64_t(hkv) * ctx * d;
  p.variant = joa::MakeVariant(joa::VariantAttrs{0.088f, 0.f, true, -1, -1, 0});
  p.kv_format = joa::KvFormat::kDense;
  p.kv_scales = joa::KvScales{nullptr, nullptr, false, false};
  return p;
}
