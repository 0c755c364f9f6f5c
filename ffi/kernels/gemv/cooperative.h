// One cooperative launch, shared by the persistent GEMV kernels (mlp_row.cuh, row_chain.cuh) and
// their probes: their grid barriers need every CTA resident, which a cooperative launch guarantees
// (or fails with cudaErrorCooperativeLaunchTooLarge); it works inside XLA's command buffers.
#pragma once

#include <cuda_runtime.h>

namespace joa::gemv {

// kernel<<<grid, threads, smem, stream>>>(p) as a cooperative launch, the kernel's dynamic
// shared-memory limit raised first where smem passes the default 48 KB. pdl: also a programmatic
// dependent launch: the kernel may start while the previous one runs, so it must call
// ptx::WaitForPrimary before it reads anything a kernel before it wrote (W it may read first).
// Its CTAs become resident as the previous kernel's leave; the grid barrier waits for all of them.
template <class Kernel, class Params>
cudaError_t LaunchCooperative(Kernel kernel, const Params& p, int grid, int threads, int smem, cudaStream_t stream,
                              bool pdl = false) {
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 2 : 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

}  // namespace joa::gemv
