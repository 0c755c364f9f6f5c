// How many thread-block clusters of each size one wave of the GPU holds, at 1, 2 and 3 CTAs an SM
// (cudaOccupancyMaxActiveClusters): the numbers behind joa::decode::ClusterWaveCtas (plan.h).
// The CTAs an SM are set by dynamic shared memory, as the decode layouts' are (plan.h kBudget1-3);
// the kernel is empty, so registers never limit it. Prints one JSON object.
#include <cuda_runtime.h>

#include <cstdio>

__global__ void __launch_bounds__(128) Empty() {
  extern __shared__ char smem[];
  if (threadIdx.x == 1024) smem[0] = 0;
}

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  cudaFuncSetAttribute(Empty, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaFuncSetAttribute(Empty, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448);
  const int budgets[] = {232448, 115712, 75776};  // 1, 2, 3 CTAs an SM (plan.h)
  std::printf("{\"device\": \"%s\", \"sms\": %d, \"max_active_clusters\": {", prop.name, prop.multiProcessorCount);
  for (int b = 0; b < 3; ++b) {
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Empty, 128, budgets[b]);
    std::printf("%s\"%d\": [", b ? ", " : "", per_sm);
    for (int size = 1; size <= 16; ++size) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(size * 64, 1, 1);
      cfg.blockDim = dim3(128, 1, 1);
      cfg.dynamicSmemBytes = budgets[b];
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = size;
      attr.val.clusterDim.y = 1;
      attr.val.clusterDim.z = 1;
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      int clusters = -1;
      cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, (void*)Empty, &cfg);
      if (e != cudaSuccess) clusters = -1;
      std::printf("%s%d", size > 1 ? ", " : "", clusters);
    }
    std::printf("]");
  }
  std::printf("}}\n");
  return 0;
}
