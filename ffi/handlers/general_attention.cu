// general_attention: attention of a few query rows over K / V with a valid length per batch row, on
// CUDA cores; the ai.onnx Attention path for what the decode engine does not take (f32, V's dtype or
// head size differing from Q's, any head size, qk_matmul_output, a half-precision softmax).
//
// q [B, Hq, S, D], k [B, Hkv, C, D] of q's dtype, v [B, Hkv, C, Dv] (f32 / f16 / bf16), kv_len int32
// [B] (valid rows, read on the device), bias [B|1, Hq|1, S|1, T] (f32 / f16 / bf16 additive or bool
// keep-mask; a placeholder when has_bias is false)
//   -> y [B, Hq, S, Dv] of q's dtype, qk [B, Hq, S, C] of q's dtype (a placeholder when qk_mode is
//      -1), scores f32 [B * Hq * S * C] (workspace, sized by jax_onnx_attn/ops/cuda.py).
// Query row i sits at position kv_len[b] - S + i + pos_shift. Read-only on q, k, v.
#include <algorithm>
#include <cstdint>
#include <string>

#include "common/ffi.h"
#include "common/variant.h"
#include "kernels/general/general.h"
#include "kernels/general/params.h"

// Host side: shapes and the variant into GeneralParams; the launch for the runtime dtypes. Static
// shapes and attributes only.
namespace joa::general {

// f32 elements of the score workspace [B, Hq, S, C] (sized by cuda.general_attention in Python).
inline int64_t WorkspaceElems(int64_t batch, int64_t q_heads, int64_t q_len, int64_t capacity) {
  return batch * q_heads * q_len * capacity;
}

// Fills shapes and attributes of `p` for q [B, Hq, S, D], k [B, Hkv, C, D], v [B, Hkv, C, Dv]
// (pointers, kv_len and bias are the caller's). Returns an error message or "".
inline std::string Configure(GeneralParams& p, int64_t batch, int64_t q_heads, int64_t q_len,
                             int64_t head_dim, int64_t kv_heads, int64_t capacity,
                             int64_t v_head_dim, const VariantAttrs& v, int64_t qk_mode,
                             int64_t softmax_type) {
  constexpr int64_t kMaxDim = int64_t(1) << 30;
  if (kv_heads <= 0 || q_heads % kv_heads != 0) return "query heads must be a multiple of KV heads";
  const int64_t rows = (q_heads / kv_heads) * q_len;
  for (int64_t dim : {batch, q_heads, q_len, head_dim, capacity, v_head_dim, rows}) {
    if (dim < 0 || dim > kMaxDim) return "a dimension is out of range (at most 2^30)";
  }
  if (batch * kv_heads * RowBlocks(rows) > int64_t(0x7fffffff)) return "batch x heads too large for the grid";
  if (capacity > kMaxKeys) return "more than " + std::to_string(kMaxKeys) + " keys";
  if (ColumnBlocks(v_head_dim) > 65535) return "V head size too large for the grid";
  if (qk_mode < kQkNone || qk_mode > kQkSoftmax) return "qk_mode must be -1 (none) or 0-3";
  if (softmax_type < 0 || softmax_type > int64_t(SoftmaxType::kBF16)) {
    return "softmax_type must be 0 (f32), 1 (f16) or 2 (bf16)";
  }
  p.batch = int(batch);
  p.q_heads = int(q_heads);
  p.kv_heads = int(kv_heads);
  p.q_len = int(q_len);
  p.capacity = int(capacity);
  p.head_dim = int(head_dim);
  p.v_head_dim = int(v_head_dim);
  p.group = int(q_heads / kv_heads);
  p.rows = int(rows);
  p.variant = MakeVariant(v);
  p.qk_mode = int(qk_mode);
  p.softmax_type = SoftmaxType(softmax_type);
  return "";
}

// Launches the kernels for the runtime element types of q/k (`dtype`) and v (`v_dtype`).
inline ffi::Error LaunchGeneral(const GeneralParams& p, ffi::DataType dtype, ffi::DataType v_dtype,
                                cudaStream_t stream, const char* op) {
  return DispatchFloat(dtype, op, [&](auto t) {
    return DispatchFloat(v_dtype, op, [&](auto tv) {
      const cudaError_t err = Launch<decltype(t), decltype(tv)>(p, stream);
      if (err != cudaSuccess) return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(err));
      return ffi::Error::Success();
    });
  });
}

}  // namespace joa::general

namespace joa {
namespace {

using F32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

ffi::Error GeneralAttentionImpl(cudaStream_t stream, AnyBuffer q, AnyBuffer k, AnyBuffer v,
                                Int32Buffer kv_len, AnyBuffer bias, AnyResult y, AnyResult qk,
                                F32Result scores, float scale, float softcap, bool causal,
                                int64_t left, int64_t right, int64_t pos_shift, bool has_bias,
                                int64_t qk_mode, int64_t softmax_type) {
  const std::string op = "general_attention";
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return InvalidArgument(op + ": q, k and v must be rank 4");
  }
  if (k.element_type() != q.element_type() || y->element_type() != q.element_type() ||
      qk->element_type() != q.element_type()) {
    return InvalidArgument(op + ": k, y and qk must have q's dtype");
  }
  if (kd[0] != qd[0] || kd[3] != qd[3]) return InvalidArgument(op + ": k must be [B, Hkv, C, D] with q's B and D");
  if (vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2]) {
    return InvalidArgument(op + ": v must be [B, Hkv, C, Dv] with k's B, Hkv and C");
  }
  if (kv_len.dimensions().size() != 1 || kv_len.dimensions()[0] != qd[0]) {
    return InvalidArgument(op + ": kv_len must be int32 [B]");
  }
  auto yd = y->dimensions();
  if (yd.size() != 4 || yd[0] != qd[0] || yd[1] != qd[1] || yd[2] != qd[2] || yd[3] != vd[3]) {
    return InvalidArgument(op + ": y must be [B, Hq, S, Dv]");
  }
  if (qk_mode != general::kQkNone) {
    auto od = qk->dimensions();
    if (od.size() != 4 || od[0] != qd[0] || od[1] != qd[1] || od[2] != qd[2] || od[3] != kd[2]) {
      return InvalidArgument(op + ": qk must be [B, Hq, S, C]");
    }
  }
  const int64_t need = general::WorkspaceElems(qd[0], qd[1], qd[2], kd[2]);
  if (int64_t(scores->element_count()) < need) {
    return InvalidArgument(op + ": workspace has " + std::to_string(scores->element_count()) +
                           " f32 elements, needs " + std::to_string(need));
  }
  general::GeneralParams p{};
  std::string err = general::Configure(
      p, qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], vd[3],
      VariantAttrs{scale, softcap, causal, left, right, pos_shift}, qk_mode, softmax_type);
  if (err.empty() && has_bias) err = SetBias(p.variant, bias, qd[0], qd[1], qd[2]);
  if (!err.empty()) return InvalidArgument(op + ": " + err);
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.y = y->untyped_data();
  p.qk = qk->untyped_data();
  p.scores = scores->typed_data();
  p.kv_len = kv_len.typed_data();
  return general::LaunchGeneral(p, q.element_type(), v.element_type(), stream, op.c_str());
}

}  // namespace
}  // namespace joa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaGeneralAttention, joa::GeneralAttentionImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<joa::Stream>()
                                  .Arg<joa::AnyBuffer>()    // q
                                  .Arg<joa::AnyBuffer>()    // k
                                  .Arg<joa::AnyBuffer>()    // v
                                  .Arg<joa::Int32Buffer>()  // kv_len
                                  .Arg<joa::AnyBuffer>()    // bias (or placeholder)
                                  .Ret<joa::AnyBuffer>()    // y
                                  .Ret<joa::AnyBuffer>()    // qk (or placeholder)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // scores workspace
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Attr<int64_t>("pos_shift")
                                  .Attr<bool>("has_bias")
                                  .Attr<int64_t>("qk_mode")
                                  .Attr<int64_t>("softmax_type"),
                              JOA_COMMAND_BUFFER_SAFE);
