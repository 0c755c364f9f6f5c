// The fused gated MLP of one decode row, the K split (kernels/gemv/mlp_row.cuh; the N split is
// the row chain's, gemv_row_chain.cu): f16 / bf16, with and without the norm prologue.
#include "kernels/gemv/cooperative.h"
#include "kernels/gemv/mlp_row.cuh"

namespace joa::gemv {

cudaError_t LaunchMlpRow(const MlpRowParams& p, bool bf16, bool norm, int grid, cudaStream_t stream) {
  constexpr int kW = kMlpRowWarps, kD = kMlpRowDepth;
  if (!MlpRowFits<kW>(p.h, p.inter, grid) || p.tiles_per_cta * 8 * grid != p.inter) return cudaErrorInvalidValue;
  const int smem = MlpRowSmem<kW>::Bytes(p.h, p.tiles_per_cta);
  auto launch = [&](auto kernel) { return LaunchCooperative(kernel, p, grid, kW * 32, smem, stream); };
  if (bf16) {
    return norm ? launch(MlpRowKernel<__nv_bfloat16, kW, kD, true>) : launch(MlpRowKernel<__nv_bfloat16, kW, kD, false>);
  }
  return norm ? launch(MlpRowKernel<__half, kW, kD, true>) : launch(MlpRowKernel<__half, kW, kD, false>);
}

}  // namespace joa::gemv
