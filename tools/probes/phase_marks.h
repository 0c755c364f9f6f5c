// Shared by the GEMV probes: a kernel's timeline from its JOA_GEMV_MARK(phase) points (no-ops in
// the package; rows.cuh and slots.cuh define them empty unless a probe includes this header
// first). CTA 0's thread 0 and the first thread of its last warp record clock64 at each mark (a
// mark that repeats keeps its last value); thread 0 of every CTA its globaltimer at marks 0
// (start) and 6 (end). Include before the kernels' headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <initializer_list>

__device__ long long g_marks[2][8];
__device__ unsigned long long g_start_min, g_start_max, g_end_min, g_end_max;
__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
#define JOA_GEMV_MARK(phase)                                                     \
  do {                                                                           \
    if (blockIdx.x == 0 && (threadIdx.x == 0 || threadIdx.x == blockDim.x - 32)) \
      g_marks[threadIdx.x != 0][phase] = clock64();                              \
    if (threadIdx.x == 0 && ((phase) == 0 || (phase) == 6)) {                    \
      const unsigned long long gt = GlobalTimer();                               \
      atomicMin((phase) == 0 ? &g_start_min : &g_end_min, gt);                   \
      atomicMax((phase) == 0 ? &g_start_max : &g_end_max, gt);                   \
    }                                                                            \
  } while (0)

// Runs launch() (one launch, synchronised here) and prints its timeline after `label`: the marks
// in `order`, cycles from CTA 0's start (first / last warp), and the CTAs' start spread and end
// range from %globaltimer.
template <class Launch>
cudaError_t PrintTimeline(const char* label, std::initializer_list<int> order, Launch&& launch, cudaStream_t s) {
  const unsigned long long init[4] = {~0ull, 0ull, ~0ull, 0ull};
  cudaError_t err = cudaSuccess;
  if ((err = cudaMemcpyToSymbol(g_start_min, &init[0], 8)) || (err = cudaMemcpyToSymbol(g_start_max, &init[1], 8)) ||
      (err = cudaMemcpyToSymbol(g_end_min, &init[2], 8)) || (err = cudaMemcpyToSymbol(g_end_max, &init[3], 8)) ||
      (err = launch()) || (err = cudaStreamSynchronize(s))) {
    return err;
  }
  long long mk[2][8];
  unsigned long long sm0, sm1, em0, em1;
  if ((err = cudaMemcpyFromSymbol(mk, g_marks, sizeof(mk))) || (err = cudaMemcpyFromSymbol(&sm0, g_start_min, 8)) ||
      (err = cudaMemcpyFromSymbol(&sm1, g_start_max, 8)) || (err = cudaMemcpyFromSymbol(&em0, g_end_min, 8)) ||
      (err = cudaMemcpyFromSymbol(&em1, g_end_max, 8))) {
    return err;
  }
  printf("%s CTA 0 cycles from its start, first / last warp:", label);
  for (int ph : order) printf(" m%d %lld/%lld", ph, mk[0][ph] - mk[0][0], mk[1][ph] - mk[1][0]);
  printf("; CTA starts spread %.2f us, ends %.2f..%.2f us after the first start\n", (sm1 - sm0) * 1e-3,
         (em0 - sm0) * 1e-3, (em1 - sm0) * 1e-3);
  return cudaSuccess;
}
