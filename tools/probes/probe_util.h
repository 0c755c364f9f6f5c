// Shared by the GEMV probes: a CUDA error check that returns 1 from main, deterministic fills, and
// the floor every probe prints beside our kernels: a kernel that only reads W (4 x 16 bytes a
// thread in flight, L1 bypassed as the one-row kernels do).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "kernels/gemv/stage.cuh"  // LoadStream16

#define CK(...)                                                                          \
  do {                                                                                   \
    cudaError_t e = (__VA_ARGS__);                                                       \
    if (e != cudaSuccess) {                                                              \
      printf("%s:%d %s: %s\n", __FILE__, __LINE__, #__VA_ARGS__, cudaGetErrorString(e)); \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)

__device__ __forceinline__ uint32_t ProbeHash(size_t i, uint32_t seed) {
  uint32_t h = uint32_t(i) * 2654435761u ^ seed;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  return h;
}

// p[i] = hash(i, seed) & mask.
__global__ void Fill(uint8_t* p, size_t n, uint32_t seed, uint8_t mask) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    p[i] = uint8_t(ProbeHash(i, seed)) & mask;
  }
}

// p[i] uniform-ish in [lo, hi) from hash(i, seed).
__global__ void FillHalf(__half* p, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    p[i] = __float2half(lo + (hi - lo) * float(ProbeHash(i, seed) & 0xffff) / 65536.f);
  }
}

// Reads n16 16-byte units of w and nothing else (sink is written never, in practice).
__global__ void StreamKernel(const void* w, size_t n16, uint32_t* sink) {
  const uint4* w4 = static_cast<const uint4*>(w);
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16; i += 4 * size_t(gridDim.x) * blockDim.x) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const size_t at = i + u * size_t(gridDim.x) * blockDim.x;
      v[u] = at < n16 ? joa::gemv::LoadStream16(w4 + at) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}
