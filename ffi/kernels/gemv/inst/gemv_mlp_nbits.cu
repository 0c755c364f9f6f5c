// The fused gated MLP of one decode row on 4-bit weights (kernels/gemv/mlp_nbits.cuh): f16 / bf16,
// with and without the norm prologue.
#include "kernels/gemv/cooperative.h"
#include "kernels/gemv/mlp_nbits.cuh"

namespace joa::gemv {

cudaError_t LaunchMlpNbits(const MlpNbitsParams& p, bool bf16, bool norm, int grid, cudaStream_t stream) {
  constexpr int kW = kMlpNbitsWarps, kD = kMlpNbitsDepth;
  if (!MlpNbitsFits<kW>(p.h, p.inter, grid) || p.tiles_per_cta * 8 * grid != p.inter) return cudaErrorInvalidValue;
  const int smem = MlpNbitsSmem<kW>::Bytes(p.h, p.tiles_per_cta);
  auto launch = [&](auto kernel) { return LaunchCooperative(kernel, p, grid, kW * 32, smem, stream); };
  if (bf16) {
    return norm ? launch(MlpNbitsKernel<__nv_bfloat16, kW, kD, true>)
                : launch(MlpNbitsKernel<__nv_bfloat16, kW, kD, false>);
  }
  return norm ? launch(MlpNbitsKernel<__half, kW, kD, true>) : launch(MlpNbitsKernel<__half, kW, kD, false>);
}

}  // namespace joa::gemv
