// f32 <-> element type conversions (round to nearest even) for the kernels that are templated on a
// float element type (f32, f16, bf16), and the 4-wide output store of the attention engines.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace joa {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Four values of T in one aligned store (8 bytes of f16 / bf16): the engines' output vector.
template <typename T>
struct alignas(8) Vec4 {
  T v[4];
};

// x rounded to T (T's float constructor) and stored as one Vec4 at dst.
template <typename T>
__device__ __forceinline__ void StoreVec4(T* dst, float4 x) {
  Vec4<T> y;
  y.v[0] = T(x.x); y.v[1] = T(x.y); y.v[2] = T(x.z); y.v[3] = T(x.w);
  *reinterpret_cast<Vec4<T>*>(dst) = y;
}

}  // namespace joa
