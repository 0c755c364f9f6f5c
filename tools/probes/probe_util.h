// Shared by the GEMV probes: a CUDA error check that returns 1 from main, deterministic fills, and
// the floor every probe prints beside our kernels: a kernel that only reads W (4 x 16 bytes a
// thread in flight, L1 bypassed as the one-row kernels do).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

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

// What the timing loops need: the SM count (the stream kernel's grid), a non-blocking stream, and a
// sink for the stream kernel.
struct ProbeEnv {
  int sms = 0;
  cudaStream_t stream = nullptr;
  uint32_t* sink = nullptr;
};
inline cudaError_t MakeProbeEnv(ProbeEnv& env) {
  cudaError_t e = cudaDeviceGetAttribute(&env.sms, cudaDevAttrMultiProcessorCount, 0);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&env.stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaMalloc(&env.sink, 16);
  return e;
}

// A ~1B and a ~8B decoder's projections (K, N) with the fusions the lowering gives them.
struct Shape {
  const char* name;
  int k, n;
  bool norm, gated;
};
inline const Shape kDecoderShapes[] = {{"o 2048x2048", 2048, 2048, false, false},
                                       {"qkv 2048x3072 +norm", 2048, 3072, true, false},
                                       {"gate-up 2048x16384 +norm gated", 2048, 16384, true, true},
                                       {"down 8192x2048", 8192, 2048, false, false},
                                       {"lm 2048x128256 +norm", 2048, 128256, true, false},
                                       {"8b-o 4096x4096", 4096, 4096, false, false},
                                       {"8b-qkv 4096x6144 +norm", 4096, 6144, true, false},
                                       {"8b-gate-up 4096x28672 +norm gated", 4096, 28672, true, true},
                                       {"8b-down 14336x4096", 14336, 4096, false, false},
                                       {"8b-lm 4096x128256 +norm", 4096, 128256, true, false}};

// Whether a probe runs `sh`: JOA_PROBE_8B unset or 0 the ~1B shapes, 1 both, 2 the ~8B ones only;
// JOA_PROBE_ONLY=<prefix> the shapes whose name starts with it (e.g. one launch for ncu).
inline bool ProbeWants(const Shape& sh) {
  const int with_8b = getenv("JOA_PROBE_8B") ? atoi(getenv("JOA_PROBE_8B")) : 0;
  const char* only = getenv("JOA_PROBE_ONLY");
  const bool is_8b = sh.name[0] == '8';
  if (is_8b ? with_8b == 0 : with_8b == 2) return false;
  return only == nullptr || std::string(sh.name).rfind(only, 0) == 0;
}
