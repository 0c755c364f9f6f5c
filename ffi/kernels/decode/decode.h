// The decode engine as handlers see it: one call for any supported dtype, head dim and cache format.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/decode/params.h"
#include "kernels/decode/plan.h"

namespace joa::decode {

template <typename T, int kD, KvFormat kKv>
cudaError_t Launch(const DecodeParams& p, const LaunchOptions& opt, cudaStream_t stream);

#define JOA_DECODE_HEAD_DIMS(X, T, F) X(T, 64, F) X(T, 80, F) X(T, 96, F) X(T, 128, F) X(T, 256, F)
#define JOA_DECODE_DECLARE(T, D, F) \
  extern template cudaError_t Launch<T, D, F>(const DecodeParams&, const LaunchOptions&, cudaStream_t);
#define JOA_DECODE_DECLARE_FORMATS(T)                         \
  JOA_DECODE_HEAD_DIMS(JOA_DECODE_DECLARE, T, KvFormat::kDense) \
  JOA_DECODE_HEAD_DIMS(JOA_DECODE_DECLARE, T, KvFormat::kInt8)  \
  JOA_DECODE_HEAD_DIMS(JOA_DECODE_DECLARE, T, KvFormat::kInt4)
JOA_DECODE_DECLARE_FORMATS(__half)
JOA_DECODE_DECLARE_FORMATS(__nv_bfloat16)
#undef JOA_DECODE_DECLARE_FORMATS
#undef JOA_DECODE_DECLARE

template <typename T, KvFormat kKv>
cudaError_t LaunchFormat(int d, const DecodeParams& p, const LaunchOptions& opt, cudaStream_t stream) {
  switch (d) {
    case 64: return Launch<T, 64, kKv>(p, opt, stream);
    case 80: return Launch<T, 80, kKv>(p, opt, stream);
    case 96: return Launch<T, 96, kKv>(p, opt, stream);
    case 128: return Launch<T, 128, kKv>(p, opt, stream);
    case 256: return Launch<T, 256, kKv>(p, opt, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Launches the engine for head dim `d` (one of SupportedHeadDim) and the cache format p.kv_format.
template <typename T>
cudaError_t LaunchHeadDim(int d, const DecodeParams& p, const LaunchOptions& opt, cudaStream_t stream) {
  switch (p.kv_format) {
    case KvFormat::kInt8: return LaunchFormat<T, KvFormat::kInt8>(d, p, opt, stream);
    case KvFormat::kInt4: return LaunchFormat<T, KvFormat::kInt4>(d, p, opt, stream);
    default: return LaunchFormat<T, KvFormat::kDense>(d, p, opt, stream);
  }
}

}  // namespace joa::decode
