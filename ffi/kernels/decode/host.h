// Host helpers shared by the operator handlers that drive the decode engine: validation of the
// dense BHSD / cache layouts, the workspace size, and the launch itself. Everything here depends on
// static shapes and attributes only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/ffi.h"
#include "common/variant.h"
#include "kernels/decode/decode.h"
#include "kernels/decode/params.h"
#include "kernels/decode/plan.h"

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
inline ffi::Error LaunchDecode(DecodeParams& p, ffi::DataType dtype, int64_t head_dim, float* workspace,
                               int64_t workspace_elems, bool pdl, cudaStream_t stream, const char* op) {
  if (p.cluster > 1) {  // the in-cluster combine (cluster_combine.cuh): checked, no workspace
    int dev = 0, major = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (major < 9) return InvalidArgument(std::string(op) + ": cluster combine needs sm_90 or newer");
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
  const LaunchOptions opt{p.variant.softcap > 0.f || p.variant.bias != nullptr, pdl};
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
