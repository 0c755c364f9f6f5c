// Host helpers for the handlers that drive the general kernels: validation of the dense layouts,
// the workspace size, and the launch for the runtime dtypes. Static shapes and attributes only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/ffi.h"
#include "common/variant.h"
#include "kernels/general/general.h"
#include "kernels/general/params.h"

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
