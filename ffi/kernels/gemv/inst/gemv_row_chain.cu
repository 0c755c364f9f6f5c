// A chain of one-row dense projections in one persistent launch (kernels/gemv/row_chain.cuh), f16 / bf16.
#include "kernels/gemv/cooperative.h"
#include "kernels/gemv/row_chain.cuh"

namespace joa::gemv {

cudaError_t LaunchRowChain(const RowChainParams& p, bool bf16, int grid, cudaStream_t stream) {
  constexpr int kW = kRowChainWarps, kD = kRowChainDepth;
  if (!RowChainFits<kW>(p, grid)) return cudaErrorInvalidValue;
  const int smem = RowChainSmemBytes<kW>(RowChainMaxK(p));
  auto launch = [&](auto kernel) { return LaunchCooperative(kernel, p, grid, kW * 32, smem, stream); };
  return bf16 ? launch(RowChainKernel<__nv_bfloat16, kW, kD>) : launch(RowChainKernel<__half, kW, kD>);
}

}  // namespace joa::gemv
