// decode_attention: attention of a few query rows over a fixed-capacity KV cache, the ai.onnx
// Attention decode path (and any caller with BHSD tensors).
//
// q [B, Hq, S, D], k_cache / v_cache [B, Hkv, C, D], kv_len int32 [B] (valid rows, read on the
// device), bias [B|1, Hq|1, S|1, T] (f32 / f16 / bf16 additive or bool keep-mask; a placeholder when
// has_bias is false), sink f32 [Hq] (placeholder when has_sink is false), k_scale / v_scale f32
// (kv_bits 8: int8 caches [B, Hkv, C, D]; 4: uint8 [B, Hkv, C, D / 2], two values a byte; a scale
// has 1 or Hkv * D elements; placeholders when kv_bits is 0); quant_regs: dequantise such a cache in
// registers (engine_qregs.cuh) rather than tile by tile in shared memory; cursor_loads: copy a
// float cache's tiles through per-thread row cursors (DenseCursorKv, kv_format.cuh; same bits);
// producer: copy a float cache's tiles by a producer warp with bulk copies (DenseProducerKv; same
// bits; sm_90 only, ignored on other GPUs); tile128: the wide KV tile for a float cache's 16-row
// blocks at head dims 64 / 128 whose splits are whole 128-row tiles (LaunchOptions::tile128; not the
// default tile's bits; ignored elsewhere and where the producer runs); key_rows: blocks of at most
// 8 query rows put the keys in the MMAs' rows (key_rows.cuh; LaunchOptions::key_rows)
//   -> out [B, Hq, S, D], workspace f32 (sized by the plan: kernels/decode/plan.h).
// Query row i sits at position kv_len[b] - S + i + pos_shift (pos_shift 0: bottom-right causal). Read-only on the caches.
#include <algorithm>
#include <cstdint>
#include <string>

#include "common/device.h"
#include "common/ffi.h"
#include "common/variant.h"
#include "kernels/decode/decode.h"
#include "kernels/decode/params.h"
#include "kernels/decode/plan.h"

// Host side: shapes, strides and the variant into DecodeParams; the workspace check and the launch
// for the runtime dtype and head dim. Static shapes and attributes only.
namespace joa::decode {

// Fills shapes, strides, splits and variant of `p` for dense q / out [B, Hq, S, D] and caches
// [B, Hkv, C, D] (pointers, kv_len, bias and sink are the caller's). Returns an error message or "".
inline std::string Configure(DecodeParams& p, int64_t batch, int64_t q_heads, int64_t q_len,
                             int64_t head_dim, int64_t kv_heads, int64_t capacity,
                             int64_t split_rows, const VariantAttrs& v) {
  if (!SupportedHeadDim(int(head_dim))) {
    return "head dim " + std::to_string(head_dim) + " is not one the engine is compiled for";
  }
  if (kv_heads <= 0 || q_heads % kv_heads != 0) return "query heads must be a multiple of KV heads";
  if (capacity <= 0 || capacity > (int64_t(1) << 30)) return "cache capacity out of range";
  if (split_rows <= 0 || split_rows % kBlockN != 0) {
    return "split_rows must be a positive multiple of " + std::to_string(kBlockN);
  }
  const int64_t splits = (capacity + split_rows - 1) / split_rows;
  if (splits > kMaxSplits) return "more than " + std::to_string(kMaxSplits) + " splits: raise split_rows";
  const int64_t rows = (q_heads / kv_heads) * q_len;
  if (batch > 65535 || kv_heads * ((rows + 15) / 16) > 65535) return "batch or heads too large for the grid";
  p.batch = int(batch);
  p.q_heads = int(q_heads);
  p.kv_heads = int(kv_heads);
  p.q_len = int(q_len);
  p.capacity = int(capacity);
  p.group = int(q_heads / kv_heads);
  p.rows = int(rows);
  p.splits = int(splits);
  p.split_rows = int(std::min<int64_t>(split_rows, int64_t(1) << 30));
  p.q_stride_s = p.o_stride_s = head_dim;
  p.q_stride_h = p.o_stride_h = q_len * head_dim;
  p.q_stride_b = p.o_stride_b = q_heads * q_len * head_dim;
  p.k_stride_n = p.v_stride_n = head_dim;
  p.k_stride_h = p.v_stride_h = capacity * head_dim;
  p.k_stride_b = p.v_stride_b = kv_heads * capacity * head_dim;
  p.variant = MakeVariant(v);
  p.part_o = p.part_lse = nullptr;
  p.cluster = 0;
  p.kv_format = KvFormat::kDense;
  p.kv_scales = KvScales{nullptr, nullptr, false, false};
  return "";
}

// Switches p (after Configure) to a quantized cache: kv_bits 8 (int8 [B, Hkv, C, D]) or 4 (uint8
// [B, Hkv, C, D / 2]), with f32 scales of 1 element (per tensor) or Hkv * D (per channel, [Hkv, D]).
// The caller checks the caches' dtypes and shapes.
inline std::string ConfigureKvQuant(DecodeParams& p, int64_t kv_bits, int64_t head_dim,
                                    const ffi::Buffer<ffi::F32>& k_scale,
                                    const ffi::Buffer<ffi::F32>& v_scale) {
  if (kv_bits != 8 && kv_bits != 4) return "kv_bits must be 0, 4 or 8";
  const int64_t channels = int64_t(p.kv_heads) * head_dim;
  const int64_t k_n = int64_t(k_scale.element_count()), v_n = int64_t(v_scale.element_count());
  if ((k_n != 1 && k_n != channels) || (v_n != 1 && v_n != channels)) {
    return "k_scale / v_scale must have 1 element (per tensor) or Hkv * D = " +
           std::to_string(channels) + " (per channel)";
  }
  p.kv_format = kv_bits == 8 ? KvFormat::kInt8 : KvFormat::kInt4;
  const int64_t row = KvRowElems(head_dim, p.kv_format);  // strides count bytes
  p.k_stride_n = p.v_stride_n = row;
  p.k_stride_h = p.v_stride_h = int64_t(p.capacity) * row;
  p.k_stride_b = p.v_stride_b = int64_t(p.kv_heads) * p.capacity * row;
  p.kv_scales = KvScales{k_scale.typed_data(), v_scale.typed_data(), k_n != 1, v_n != 1};
  return "";
}

// Points the partials at the workspace (checking its size) and launches the engine.
// quant_regs: an int8 / int4 cache dequantised in registers (engine_qregs.cuh) instead of tile by
// tile in shared memory; ignored for a dense cache. cursor_loads: LaunchOptions::cursor_loads.
// producer: LaunchOptions::producer where the GPU is sm_90 (CC 9.0, whose sm_90a code has it);
// ignored elsewhere, like the cursor loads where they do not apply: the bits are the same.
// key_rows: LaunchOptions::key_rows.
inline ffi::Error LaunchDecode(DecodeParams& p, ffi::DataType dtype, int64_t head_dim, float* workspace,
                               int64_t workspace_elems, bool pdl, cudaStream_t stream, const char* op,
                               bool quant_regs = false, bool cursor_loads = false, bool producer = false,
                               bool tile128 = false, bool key_rows = false) {
  if (p.cluster > 1) {  // the in-cluster combine (cluster_combine.cuh): checked, no workspace
    if (CurrentComputeCapability().major < 9) return InvalidArgument(std::string(op) + ": cluster combine needs sm_90 or newer");
    if (p.splits > kMaxClusterSplits || BlockRows(p.rows) != 16) {
      return InvalidArgument(std::string(op) + ": cluster combine takes 2-" +
                             std::to_string(kMaxClusterSplits) + " splits of at most 16 packed rows");
    }
  }
  const int64_t need = p.cluster > 1 ? 0 : WorkspaceElems(p.batch, p.kv_heads, p.splits, p.rows, head_dim);
  if (workspace_elems < need) {
    return InvalidArgument(std::string(op) + ": workspace has " + std::to_string(workspace_elems) +
                           " f32 elements, needs " + std::to_string(need));
  }
  if (p.splits > 1 && p.cluster <= 1) {
    p.part_o = workspace;
    p.part_lse = workspace + int64_t(p.batch) * p.kv_heads * p.splits * p.rows * head_dim;
  }
  if (p.batch == 0 || p.rows == 0) return ffi::Error::Success();
  if (producer) {  // a device attribute: no stream work
    const ComputeCapability cc = CurrentComputeCapability();
    producer = p.kv_format == KvFormat::kDense && cc.major == 9 && cc.minor == 0;
  }
  const LaunchOptions opt{p.variant.softcap > 0.f || p.variant.bias != nullptr, pdl, quant_regs,
                          cursor_loads, producer, tile128, key_rows};
  cudaError_t err;
  switch (dtype) {
    case ffi::DataType::F16: err = LaunchHeadDim<__half>(int(head_dim), p, opt, stream); break;
    case ffi::DataType::BF16: err = LaunchHeadDim<__nv_bfloat16>(int(head_dim), p, opt, stream); break;
    default: return InvalidArgument(std::string(op) + ": the decode kernels take f16 and bf16 only");
  }
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace joa::decode

namespace joa {
namespace {

using F32Buffer = ffi::Buffer<ffi::F32>;
using F32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

ffi::Error DecodeAttentionImpl(cudaStream_t stream, AnyBuffer q, AnyBuffer k, AnyBuffer v,
                               Int32Buffer kv_len, AnyBuffer bias, F32Buffer sink, F32Buffer k_scale,
                               F32Buffer v_scale, AnyResult out, F32Result workspace, float scale,
                               float softcap, bool causal, int64_t left, int64_t right,
                               int64_t pos_shift, bool has_bias, bool has_sink, int64_t kv_bits,
                               int64_t split_rows, bool pdl, bool cluster, bool quant_regs,
                               bool cursor_loads, bool producer, bool tile128, bool key_rows) {
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
                              int64_t(workspace->element_count()), pdl, stream, kOp, quant_regs,
                              cursor_loads, producer, tile128, key_rows);
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
                                  .Attr<bool>("cluster")
                                  .Attr<bool>("quant_regs")
                                  .Attr<bool>("cursor_loads")
                                  .Attr<bool>("producer")
                                  .Attr<bool>("tile128")
                                  .Attr<bool>("key_rows"),
                              JOA_COMMAND_BUFFER_SAFE);
