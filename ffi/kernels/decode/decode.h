// The decode engine as handlers see it: one call for any supported dtype and head dim.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/decode/params.h"

namespace joa::decode {

template <typename T, int kD>
cudaError_t Launch(const DecodeParams& p, const LaunchOptions& opt, cudaStream_t stream);

#define JOA_DECODE_HEAD_DIMS(X, T) X(T, 64) X(T, 80) X(T, 96) X(T, 128) X(T, 256)
#define JOA_DECODE_DECLARE(T, D) \
  extern template cudaError_t Launch<T, D>(const DecodeParams&, const LaunchOptions&, cudaStream_t);
JOA_DECODE_HEAD_DIMS(JOA_DECODE_DECLARE, __half)
JOA_DECODE_HEAD_DIMS(JOA_DECODE_DECLARE, __nv_bfloat16)
#undef JOA_DECODE_DECLARE

inline bool SupportedHeadDim(int d) { return d == 64 || d == 80 || d == 96 || d == 128 || d == 256; }

// Launches the engine for head dim `d` (one of SupportedHeadDim).
template <typename T>
cudaError_t LaunchHeadDim(int d, const DecodeParams& p, const LaunchOptions& opt, cudaStream_t stream) {
  switch (d) {
    case 64: return Launch<T, 64>(p, opt, stream);
    case 80: return Launch<T, 80>(p, opt, stream);
    case 96: return Launch<T, 96>(p, opt, stream);
    case 128: return Launch<T, 128>(p, opt, stream);
    case 256: return Launch<T, 256>(p, opt, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace joa::decode
