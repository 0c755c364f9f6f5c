// gqa_prepare: one launch that turns a GroupQueryAttention decode / verify step's inputs into what
// the decode engine reads. Semantics: jax_onnx_attn/ops/reference/gqa.py `prepare_step`.
//
// query [B, S, N·D] (or packed Q|K|V [B, S, (N + 2·Hkv)·D]), key / value [B, S, Hkv·D]
// (placeholders when packed), k_cache / v_cache [B, Hkv, C, Dc] (aliased to results 1 and 2; the
// query's dtype T, int8 for kv_bits 8, uint8 with Dc = D / 2 for kv_bits 4), seqlens_k int32 [B],
// cos / sin [max_position, R/2] T, position_ids int32 [B, S], q / k norm weights [D] T, k / v
// scales f32 [1] or [Hkv·D] (each a placeholder when unused)
//   -> q [B, N, S, D], k_cache, v_cache, status int32 [B].
//
// Per (b, s, head) row: split, per-head RMS norm of Q and K, rotary on Q and K, then Q to the
// output and K / V to cache row past_b + s, past_b = seqlens_k[b] + 1 - S. A batch row whose S rows
// do not all fit in [0, C) writes no K / V and gets status kKvWriteOutOfRange (its Q is written).
// seqlens_k and position_ids are read on the device; the launch depends on static shapes only.
// The kernel: kernels/gqa/prepare.cuh.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/ffi.h"
#include "kernels/gqa/prepare.cuh"

namespace joa {
namespace {

using F32Buffer = ffi::Buffer<ffi::F32>;
using gqa::kChunk;
using gqa::kMaxHeadDim;
using gqa::kMaxLanes;
using gqa::kThreads;

template <typename Dims>
std::string Shape(const Dims& dims) {
  std::string out = "[";
  for (int64_t n : dims) out += (out.size() > 1 ? ", " : "") + std::to_string(n);
  return out + "]";
}

std::string Shape(std::initializer_list<int64_t> dims) { return Shape<decltype(dims)>(dims); }

ffi::Error GqaPrepareImpl(cudaStream_t stream, AnyBuffer query, AnyBuffer key, AnyBuffer value,
                          AnyBuffer k_cache, AnyBuffer v_cache, Int32Buffer seqlens_k,
                          AnyBuffer cos, AnyBuffer sin, Int32Buffer position_ids, AnyBuffer q_norm,
                          AnyBuffer k_norm, F32Buffer k_scale, F32Buffer v_scale, AnyResult q_out,
                          AnyResult k_cache_out, AnyResult v_cache_out, Int32Result status,
                          int64_t num_heads, int64_t kv_num_heads, bool packed, bool do_rotary,
                          bool rotary_interleaved, bool has_position_ids, bool has_norm,
                          float q_norm_epsilon, float k_norm_epsilon, int64_t kv_bits) {
  auto fail = [](const std::string& what) { return InvalidArgument("gqa_prepare: " + what); };
  const ffi::DataType dtype = query.element_type();
  auto qd = query.dimensions();
  if (qd.size() != 3) return fail("query must be [B, S, hidden], got " + Shape(qd));
  // Only what guards memory: the shapes and dtypes of what the kernel reads and writes. The rules of
  // GroupQueryAttention are checked once, in Python (jax_onnx_attn/ops/gqa.py).
  if (num_heads <= 0 || kv_num_heads <= 0) return fail("num_heads and kv_num_heads must be positive");
  const int64_t batch = qd[0], seq = qd[1];
  const int64_t heads_in_query = packed ? num_heads + 2 * kv_num_heads : num_heads;
  if (qd[2] % heads_in_query != 0) return fail("query hidden size is not a multiple of its heads");
  const int64_t d = qd[2] / heads_in_query;
  if (d % kChunk != 0 || d > kMaxHeadDim || d == 0) {
    return fail("head size must be a multiple of 8 in [8, 256], got " + std::to_string(d));
  }
  if (seq < 1) return fail("query must have at least one row");
  if (!packed) {
    for (const AnyBuffer* x : {&key, &value}) {
      if (x->element_type() != dtype || !HasShape(*x, {batch, seq, kv_num_heads * d})) {
        return fail("key and value must be [B, S, Hkv·D] = " +
                    Shape({batch, seq, kv_num_heads * d}) + " in the query's dtype");
      }
    }
  }
  KvFormat format;
  ffi::DataType cache_type = dtype;
  switch (kv_bits) {
    case 0: format = KvFormat::kDense; break;
    case 8: format = KvFormat::kInt8; cache_type = ffi::DataType::S8; break;
    case 4: format = KvFormat::kInt4; cache_type = ffi::DataType::U8; break;
    default: return fail("kv_bits must be 0, 4 or 8, got " + std::to_string(kv_bits));
  }
  const int64_t cache_d = KvRowElems(d, format);
  auto cd = k_cache.dimensions();
  if (cd.size() != 4 || cd[0] != batch || cd[1] != kv_num_heads || cd[3] != cache_d) {
    return fail("k_cache must be [B, Hkv, C, " + std::to_string(cache_d) + "], got " + Shape(cd));
  }
  const int64_t capacity = cd[2];
  if (!HasShape(v_cache, {batch, kv_num_heads, capacity, cache_d})) {
    return fail("v_cache must have k_cache's shape " + Shape(cd) + ", got " +
                Shape(v_cache.dimensions()));
  }
  if (k_cache.element_type() != cache_type || v_cache.element_type() != cache_type) {
    return fail("caches must be the query's dtype (kv_bits 0), int8 (8) or uint8 (4)");
  }
  if (capacity > (int64_t(1) << 30)) return fail("cache capacity must be at most 2^30, got " + std::to_string(capacity));
  if (seqlens_k.dimensions().size() != 1 || seqlens_k.dimensions()[0] != batch) {
    return fail("seqlens_k must be int32 [B]");
  }
  if (!HasShape(*q_out, {batch, num_heads, seq, d}) || q_out->element_type() != dtype) {
    return fail("q output must be [B, N, S, D] in the query's dtype");
  }
  int64_t half = 0, max_position = 0;
  if (do_rotary) {
    auto rd = cos.dimensions();
    if (rd.size() != 2 || cos.element_type() != dtype || sin.element_type() != dtype ||
        !HasShape(sin, {rd[0], rd[1]})) {
      return fail("cos_cache and sin_cache must both be [max_position, R/2] in the query's dtype");
    }
    half = rd[1];
    max_position = rd[0];
    if (half == 0 || half % kChunk != 0 || 2 * half > d || max_position < 1) {
      return fail("cos_cache must be [max_position >= 1, R/2], R/2 a multiple of 8, R <= D; got " +
                  Shape(rd));
    }
    auto pd = position_ids.dimensions();
    if (has_position_ids && (pd.size() != 2 || pd[0] != batch || pd[1] != seq)) {
      return fail("position_ids must be int32 [B, S]");
    }
  }
  if (has_norm) {
    for (const AnyBuffer* w : {&q_norm, &k_norm}) {
      if (w->element_type() != dtype || !HasShape(*w, {d})) {
        return fail("q_norm_weight and k_norm_weight must be [D] in the query's dtype");
      }
    }
  }
  if (kv_bits != 0) {
    for (const F32Buffer* sc : {&k_scale, &v_scale}) {
      const int64_t n = int64_t(sc->element_count());
      if (n != 1 && n != kv_num_heads * d) {
        return fail("k_scale and v_scale must have 1 (per tensor) or Hkv·D (per channel) floats");
      }
    }
  }
  if (batch == 0) return ffi::Error::Success();
  if (batch * seq * (num_heads + 2 * kv_num_heads) * kMaxLanes / kThreads >= INT32_MAX) {
    return fail("too many rows for one launch");
  }

  gqa::PrepareParams p{};
  p.query = query.untyped_data();
  p.key = packed ? nullptr : key.untyped_data();
  p.value = packed ? nullptr : value.untyped_data();
  p.seqlens = seqlens_k.typed_data();
  p.cos = do_rotary ? cos.untyped_data() : nullptr;
  p.sin = do_rotary ? sin.untyped_data() : nullptr;
  p.position_ids = do_rotary && has_position_ids ? position_ids.typed_data() : nullptr;
  p.q_norm = has_norm ? q_norm.untyped_data() : nullptr;
  p.k_norm = has_norm ? k_norm.untyped_data() : nullptr;
  p.k_scale = k_scale.typed_data();
  p.v_scale = v_scale.typed_data();
  p.q_out = q_out->untyped_data();
  p.k_cache = k_cache_out->untyped_data();
  p.v_cache = v_cache_out->untyped_data();
  p.status = status->typed_data();
  p.batch = int(batch);
  p.seq = int(seq);
  p.heads = int(num_heads);
  p.kv_heads = int(kv_num_heads);
  p.head_dim = int(d);
  p.capacity = int(capacity);
  p.rotary_half = int(half);
  p.max_position = int(std::min<int64_t>(max_position, INT32_MAX));
  p.packed = packed;
  p.interleaved = rotary_interleaved;
  p.k_per_channel = k_scale.element_count() > 1;
  p.v_per_channel = v_scale.element_count() > 1;
  p.q_eps = q_norm_epsilon;
  p.k_eps = k_norm_epsilon;
  ffi::Error err = DispatchFloat(dtype, "gqa_prepare", [&](auto t) {
    using T = decltype(t);
    switch (format) {
      case KvFormat::kDense: gqa::Launch<T, KvFormat::kDense>(p, stream); break;
      case KvFormat::kInt8: gqa::Launch<T, KvFormat::kInt8>(p, stream); break;
      case KvFormat::kInt4: gqa::Launch<T, KvFormat::kInt4>(p, stream); break;
    }
    return ffi::Error::Success();
  });
  if (err.failure()) return err;
  return LaunchStatus("gqa_prepare");
}

}  // namespace
}  // namespace joa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaGqaPrepare, joa::GqaPrepareImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<joa::Stream>()
                                  .Arg<joa::AnyBuffer>()    // query (packed Q|K|V when packed)
                                  .Arg<joa::AnyBuffer>()    // key (or placeholder)
                                  .Arg<joa::AnyBuffer>()    // value (or placeholder)
                                  .Arg<joa::AnyBuffer>()    // k_cache (aliased to result 1)
                                  .Arg<joa::AnyBuffer>()    // v_cache (aliased to result 2)
                                  .Arg<joa::Int32Buffer>()  // seqlens_k
                                  .Arg<joa::AnyBuffer>()    // cos_cache (or placeholder)
                                  .Arg<joa::AnyBuffer>()    // sin_cache (or placeholder)
                                  .Arg<joa::Int32Buffer>()  // position_ids (or placeholder)
                                  .Arg<joa::AnyBuffer>()    // q_norm_weight (or placeholder)
                                  .Arg<joa::AnyBuffer>()    // k_norm_weight (or placeholder)
                                  .Arg<joa::F32Buffer>()    // k_scale (or placeholder)
                                  .Arg<joa::F32Buffer>()    // v_scale (or placeholder)
                                  .Ret<joa::AnyBuffer>()    // q [B, N, S, D]
                                  .Ret<joa::AnyBuffer>()    // k_cache
                                  .Ret<joa::AnyBuffer>()    // v_cache
                                  .Ret<joa::Int32Buffer>()  // status
                                  .Attr<int64_t>("num_heads")
                                  .Attr<int64_t>("kv_num_heads")
                                  .Attr<bool>("packed")
                                  .Attr<bool>("do_rotary")
                                  .Attr<bool>("rotary_interleaved")
                                  .Attr<bool>("has_position_ids")
                                  .Attr<bool>("has_norm")
                                  .Attr<float>("q_norm_epsilon")
                                  .Attr<float>("k_norm_epsilon")
                                  .Attr<int64_t>("kv_bits"),
                              JOA_COMMAND_BUFFER_SAFE);
