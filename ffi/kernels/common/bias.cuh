// An attention bias as every kernel family reads it: an additive float (f32 / f16 / bf16) or a
// boolean keep-mask, [B|1, Hq|1, S|1, T] with zero strides along broadcast dims. Parsed from an FFI
// buffer once, by common/bias.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/common/params.h"

namespace joa {

// Element i of the bias as an additive logit (a false keep-mask entry hides the key: -inf).
__device__ __forceinline__ float BiasValue(const void* bias, BiasType type, int64_t i) {
  switch (type) {
    case BiasType::kF32: return static_cast<const float*>(bias)[i];
    case BiasType::kF16: return __half2float(static_cast<const __half*>(bias)[i]);
    case BiasType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[i]);
    case BiasType::kBool: return static_cast<const bool*>(bias)[i] ? 0.f : -INFINITY;
    default: return 0.f;
  }
}

}  // namespace joa
