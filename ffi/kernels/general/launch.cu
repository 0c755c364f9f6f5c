// Launch of the general attention kernels, instantiated for every (Q/K dtype, V dtype) pair.
#include "kernels/general/general.h"
#include "kernels/general/kernels.cuh"

namespace joa::general {

template <typename T, typename TV>
cudaError_t Launch(const GeneralParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.kv_heads == 0 || p.rows == 0) return cudaSuccess;
  const auto row_ctas = unsigned(int64_t(p.batch) * p.kv_heads * RowBlocks(p.rows));
  if (p.capacity > 0) {
    ScoresKernel<T><<<dim3(row_ctas, unsigned(KeyTiles(p.capacity))), kThreads, 0, stream>>>(p);
  }
  // Also without keys or value columns: it writes y = 0 and the mode-3 qk.
  SoftmaxValuesKernel<T, TV>
      <<<dim3(row_ctas, unsigned(ColumnBlocks(p.v_head_dim))), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

#define JOA_GENERAL_INSTANTIATE(T, TV) \
  template cudaError_t Launch<T, TV>(const GeneralParams&, cudaStream_t);
JOA_GENERAL_DTYPE_PAIRS(JOA_GENERAL_INSTANTIATE)
#undef JOA_GENERAL_INSTANTIATE

}  // namespace joa::general
