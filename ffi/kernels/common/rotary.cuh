// Rotary position embedding of one (x1, x2) pair, the one place its rounding is written: the
// reference (jax_onnx_attn/ops/reference/rotary.py) computes (x1·cos − x2·sin, x2·cos + x1·sin) in
// f32 from values already rounded to T and rounds the results to T; XLA's GPU backend (LLVM FMA
// fusion) contracts each into fma(x1, cos, −x2·sin) and fma(x2, cos, x1·sin), so the kernels
// write that contraction. Used by gqa_prepare (kernels/gqa/prepare.cuh) and the GEMV's fused
// QKV epilogue (kernels/gemv/epilogue.cuh), which must give the same bits.
#pragma once

#include "kernels/convert.cuh"

namespace joa {

// x rounded to T, as the spec's astype(T) between its steps.
template <typename T>
__device__ __forceinline__ float RoundTo(float x) { return ToFloat(FromFloat<T>(x)); }

// The first element of a pair: x1 -> x1·cos − x2·sin, rounded to T.
template <typename T>
__device__ __forceinline__ float RotaryFirst(float x1, float x2, float c, float s) {
  return RoundTo<T>(fmaf(x1, c, -__fmul_rn(x2, s)));
}

// The second element of a pair: x2 -> x2·cos + x1·sin, rounded to T.
template <typename T>
__device__ __forceinline__ float RotarySecond(float x1, float x2, float c, float s) {
  return RoundTo<T>(fmaf(x2, c, __fmul_rn(x1, s)));
}

}  // namespace joa
