// The fused gated MLP of one decode row (kernels/gemv/mlp_row.cuh): the K and N splits, f16 / bf16,
// with and without the norm prologue.
#include "kernels/gemv/cooperative.h"
#include "kernels/gemv/mlp_row.cuh"

namespace joa::gemv {

cudaError_t LaunchMlpRow(const MlpRowParams& p, bool bf16, bool norm, int grid, bool n_split, cudaStream_t stream) {
  if (!MlpRowTakes(p.h, p.inter, grid, n_split) || p.tiles_per_cta * 8 * grid != p.inter) return cudaErrorInvalidValue;
  const int threads = (n_split ? kMlpRowNWarps : kMlpRowWarps) * 32;
  const int smem = n_split ? MlpRowNSmem<kMlpRowNWarps>::Bytes(p.h, p.inter)
                           : MlpRowSmem<kMlpRowWarps>::Bytes(p.h, p.tiles_per_cta);
  auto launch = [&](auto kernel) { return LaunchCooperative(kernel, p, grid, threads, smem, stream); };
  if (n_split) {
    constexpr int kW = kMlpRowNWarps, kD = kMlpRowNDepth;
    if (bf16) {
      return norm ? launch(MlpRowNKernel<__nv_bfloat16, kW, kD, true>) : launch(MlpRowNKernel<__nv_bfloat16, kW, kD, false>);
    }
    return norm ? launch(MlpRowNKernel<__half, kW, kD, true>) : launch(MlpRowNKernel<__half, kW, kD, false>);
  }
  constexpr int kW = kMlpRowWarps, kD = kMlpRowDepth;
  if (bf16) {
    return norm ? launch(MlpRowKernel<__nv_bfloat16, kW, kD, true>) : launch(MlpRowKernel<__nv_bfloat16, kW, kD, false>);
  }
  return norm ? launch(MlpRowKernel<__half, kW, kD, true>) : launch(MlpRowKernel<__half, kW, kD, false>);
}

}  // namespace joa::gemv
