// The decode engine as handlers see it: one call for any supported dtype, head dim and cache format.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/decode/instances.h"
#include "kernels/decode/params.h"
#include "kernels/decode/plan.h"

namespace joa::decode {

template <typename T, int kD, KvFormat kKv>
cudaError_t Launch(const DecodeParams& p, const LaunchOptions& opt, cudaStream_t stream);

// Every instance is compiled in its own TU (cmake/decode_instances.cmake: the generated list).
#define JOA_DECODE_DECLARE(T, D, F) \
  extern template cudaError_t Launch<T, D, KvFormat::F>(const DecodeParams&, const LaunchOptions&, cudaStream_t);
JOA_DECODE_FOR_EACH_INSTANCE(JOA_DECODE_DECLARE)
#undef JOA_DECODE_DECLARE

template <typename T, KvFormat kKv>
cudaError_t LaunchFormat(int d, const DecodeParams& p, const LaunchOptions& opt, cudaStream_t stream) {
#define JOA_DECODE_CASE(D) \
  case D: return Launch<T, D, kKv>(p, opt, stream);
  switch (d) {
    JOA_DECODE_FOR_EACH_HEAD_DIM(JOA_DECODE_CASE)
    default: return cudaErrorInvalidValue;
  }
#undef JOA_DECODE_CASE
}

// Launches the engine for head dim `d` (one of kHeadDims) and the cache format p.kv_format.
template <typename T>
cudaError_t LaunchHeadDim(int d, const DecodeParams& p, const LaunchOptions& opt, cudaStream_t stream) {
  switch (p.kv_format) {
    case KvFormat::kInt8: return LaunchFormat<T, KvFormat::kInt8>(d, p, opt, stream);
    case KvFormat::kInt4: return LaunchFormat<T, KvFormat::kInt4>(d, p, opt, stream);
    default: return LaunchFormat<T, KvFormat::kDense>(d, p, opt, stream);
  }
}

}  // namespace joa::decode
