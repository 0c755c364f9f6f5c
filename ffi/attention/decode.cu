// decode_attention: attention of a few query rows over a fixed-capacity KV cache, the ai.onnx
// Attention decode path (and any caller with BHSD tensors).
//
// q [B, Hq, S, D], k_cache / v_cache [B, Hkv, C, D], kv_len int32 [B] (valid rows, read on the
// device), bias [B|1, Hq|1, S|1, T] (f32 / f16 / bf16 additive or bool keep-mask; a placeholder when
// has_bias is false), sink f32 [Hq] (placeholder when has_sink is false), k_scale / v_scale f32
// (kv_bits 8: int8 caches [B, Hkv, C, D]; 4: uint8 [B, Hkv, C, D / 2], two values a byte; a scale
// has 1 or Hkv * D elements; placeholders when kv_bits is 0)
//   -> out [B, Hq, S, D], workspace f32 (sized by jax_onnx_attn/ops/cuda.py).
// Query row i sits at position kv_len[b] - S + i + pos_shift (pos_shift 0: bottom-right causal). Read-only on the caches.
#include <string>

#include "common/ffi.h"
#include "kernels/decode/host.h"

namespace joa {
namespace {

using F32Buffer = ffi::Buffer<ffi::F32>;
using F32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

ffi::Error DecodeAttentionImpl(cudaStream_t stream, AnyBuffer q, AnyBuffer k, AnyBuffer v,
                               Int32Buffer kv_len, AnyBuffer bias, F32Buffer sink, F32Buffer k_scale,
                               F32Buffer v_scale, AnyResult out, F32Result workspace, float scale,
                               float softcap, bool causal, int64_t left, int64_t right,
                               int64_t pos_shift, bool has_bias, bool has_sink, int64_t kv_bits,
                               int64_t split_rows, bool pdl, bool cluster) {
  constexpr const char* kOp = "decode_attention";
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return InvalidArgument("decode_attention: q, k_cache, v_cache must be rank 4");
  }
  if (kv_bits != 0 && kv_bits != 4 && kv_bits != 8) {
    return InvalidArgument("decode_attention: kv_bits must be 0, 4 or 8");
  }
  const ffi::DataType cache_type = kv_bits == 8 ? ffi::DataType::S8
                                   : kv_bits == 4 ? ffi::DataType::U8 : q.element_type();
  if (k.element_type() != cache_type || v.element_type() != cache_type) {
    return InvalidArgument(kv_bits == 0 ? "decode_attention: q, k_cache and v_cache must share a dtype"
                           : kv_bits == 8 ? "decode_attention: kv_bits=8 takes int8 caches"
                                          : "decode_attention: kv_bits=4 takes uint8 caches");
  }
  for (int i = 0; i < 4; ++i) {
    if (kd[i] != vd[i]) return InvalidArgument("decode_attention: k_cache and v_cache shapes differ");
  }
  // An int4 cache row holds D values in D / 2 bytes.
  if (kd[0] != qd[0] || (kv_bits == 4 ? 2 * kd[3] : kd[3]) != qd[3]) {
    return InvalidArgument("decode_attention: caches must be [B, Hkv, C, D] (D / 2 bytes with "
                           "kv_bits=4) with q's B and D");
  }
  if (kv_len.dimensions().size() != 1 || kv_len.dimensions()[0] != qd[0]) {
    return InvalidArgument("decode_attention: kv_len must be int32 [B]");
  }
  decode::DecodeParams p{};
  std::string err = decode::Configure(p, qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], split_rows,
                                      VariantAttrs{scale, softcap, causal, left, right, pos_shift});
  if (err.empty() && kv_bits != 0) err = decode::ConfigureKvQuant(p, kv_bits, qd[3], k_scale, v_scale);
  if (err.empty() && has_bias) err = SetBias(p.variant, bias, qd[0], qd[1], qd[2]);
  if (err.empty() && has_sink) err = SetSink(p.variant, sink, qd[1]);
  if (!err.empty()) return InvalidArgument(std::string(kOp) + ": " + err);
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.kv_len = kv_len.typed_data();
  p.cluster = cluster && p.splits > 1 ? p.splits : 0;
  return decode::LaunchDecode(p, q.element_type(), qd[3], workspace->typed_data(),
                              int64_t(workspace->element_count()), pdl, stream, kOp);
}

}  // namespace
}  // namespace joa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaDecodeAttention, joa::DecodeAttentionImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<joa::Stream>()
                                  .Arg<joa::AnyBuffer>()    // q
                                  .Arg<joa::AnyBuffer>()    // k_cache
                                  .Arg<joa::AnyBuffer>()    // v_cache
                                  .Arg<joa::Int32Buffer>()  // kv_len
                                  .Arg<joa::AnyBuffer>()    // bias (or placeholder)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // sink (or placeholder)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // k_scale (or placeholder)
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // v_scale (or placeholder)
                                  .Ret<joa::AnyBuffer>()    // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // workspace
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Attr<int64_t>("pos_shift")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("has_sink")
                                  .Attr<int64_t>("kv_bits")
                                  .Attr<int64_t>("split_rows")
                                  .Attr<bool>("pdl")
                                  .Attr<bool>("cluster"),
                              JOA_COMMAND_BUFFER_SAFE);
