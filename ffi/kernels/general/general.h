// The general attention kernels as handlers see them: one launch per (Q/K dtype, V dtype).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/general/params.h"

namespace joa::general {

// Launches ScoresKernel then SoftmaxValuesKernel on `stream`. T: the element type of q, k, y, qk;
// TV: v's (each float, __half or __nv_bfloat16). Geometry from p's static shapes only.
template <typename T, typename TV>
cudaError_t Launch(const GeneralParams& p, cudaStream_t stream);

#define JOA_GENERAL_DTYPE_PAIRS(X)                                                     \
  X(float, float) X(float, __half) X(float, __nv_bfloat16)                             \
  X(__half, float) X(__half, __half) X(__half, __nv_bfloat16)                          \
  X(__nv_bfloat16, float) X(__nv_bfloat16, __half) X(__nv_bfloat16, __nv_bfloat16)
#define JOA_GENERAL_DECLARE(T, TV) \
  extern template cudaError_t Launch<T, TV>(const GeneralParams&, cudaStream_t);
JOA_GENERAL_DTYPE_PAIRS(JOA_GENERAL_DECLARE)
#undef JOA_GENERAL_DECLARE

}  // namespace joa::general
