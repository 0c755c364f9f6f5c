// One cooperative launch, shared by the persistent GEMV kernels (mlp_row.cuh, row_chain.cuh) and
// their probes: their grid barriers need every CTA resident, which a cooperative launch guarantees
// (or fails with cudaErrorCooperativeLaunchTooLarge); it works inside XLA's command buffers.
#pragma once

#include <cuda_runtime.h>

namespace joa::gemv {

// kernel<<<grid, threads, smem, stream>>>(p) as a cooperative launch, the kernel's dynamic
// shared-memory limit raised first where smem passes the default 48 KB.
template <class Kernel, class Params>
cudaError_t LaunchCooperative(Kernel kernel, const Params& p, int grid, int threads, int smem, cudaStream_t stream) {
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

}  // namespace joa::gemv
