// Warming L2 with bytes a later kernel will stream: the weights of the projection that reads an
// attention's output, requested while the attention runs. A decode step's attention, its
// preparation and the gaps around them are latency-bound (a few MB of KV at short contexts), so
// HBM idles for ~10 µs a layer; a prefetch issued before them moves the next GEMV's first bytes
// into L2 in that time, and the GEMV reads them from there.
//
// A prefetch has no destination and nothing waits for it: the kernel issues its requests and
// exits, the memory system carries them out behind the kernels that follow.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace joa::prefetch {

inline constexpr int kMaxBuffers = 4;
inline constexpr int kThreads = 128;

// How the requests are made: bulk copies (the TMA unit, one instruction per piece of a CTA's
// share), the same with the evict_last L2 policy, or one prefetch per 128-byte line per thread.
enum class Mode : int { kBulk = 0, kBulkEvictLast = 1, kLines = 2 };
inline constexpr int kModes = 3;

struct Params {
  const unsigned char* ptr[kMaxBuffers];
  int64_t bytes[kMaxBuffers];  // multiples of 16 (the handler rounds down)
  int count;
  int64_t total;               // sum of bytes
  int64_t per_cta;             // a CTA's share of the concatenation, a multiple of 16
};

// Calls f(pointer, bytes) for the pieces of [begin, end) of the buffers' concatenation.
template <typename F>
__device__ __forceinline__ void ForRange(const Params& p, int64_t begin, int64_t end, F&& f) {
  int64_t at = 0;
  for (int i = 0; i < p.count && at < end; ++i) {
    const int64_t lo = begin > at ? begin : at, hi = end < at + p.bytes[i] ? end : at + p.bytes[i];
    if (hi > lo) f(p.ptr[i] + (lo - at), hi - lo);
    at += p.bytes[i];
  }
}

template <Mode kMode>
__global__ void __launch_bounds__(kThreads) L2PrefetchKernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int64_t begin = int64_t(blockIdx.x) * p.per_cta;
  const int64_t end = begin + p.per_cta < p.total ? begin + p.per_cta : p.total;
  if constexpr (kMode == Mode::kLines) {
    ForRange(p, begin, end, [&](const unsigned char* src, int64_t n) {
      for (int64_t o = int64_t(threadIdx.x) * 128; o < n; o += int64_t(kThreads) * 128) {
        asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(src + o));
      }
    });
  } else {
    // Thread i issues piece i of the CTA's share (pieces of at most 16 KB, 16-byte multiples).
    const int64_t piece = (((end - begin + kThreads - 1) / kThreads + 15) / 16) * 16;
    const int64_t lo = begin + int64_t(threadIdx.x) * piece;
    const int64_t hi = lo + piece < end ? lo + piece : end;
    uint64_t policy = 0;
    if constexpr (kMode == Mode::kBulkEvictLast) {
      asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
    }
    if (lo < hi) {
      ForRange(p, lo, hi, [&](const unsigned char* src, int64_t n) {
        for (int64_t o = 0; o < n; o += 16384) {
          const uint32_t size = uint32_t(n - o < 16384 ? n - o : 16384);
          if constexpr (kMode == Mode::kBulkEvictLast) {
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;\n" ::"l"(src + o), "r"(size),
                         "l"(policy)
                         : "memory");
          } else {
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src + o), "r"(size) : "memory");
          }
        }
      });
    }
  }
#endif
}

}  // namespace joa::prefetch
