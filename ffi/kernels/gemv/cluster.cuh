// Thread-block cluster helpers of the GEMV engine (sm_90); with a cluster of 1 (or below sm_90,
// where the plan never makes one) they fall back to the CTA alone.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include <cooperative_groups.h>
#endif

namespace joa::gemv {

__device__ __forceinline__ int ClusterRank(int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster > 1) return int(cooperative_groups::this_cluster().block_rank());
#endif
  (void)cluster;
  return 0;
}

// Every thread of every CTA of the cluster (a CTA barrier without a cluster).
__device__ __forceinline__ void ClusterSync(int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster > 1) {
    cooperative_groups::this_cluster().sync();
    return;
  }
#endif
  (void)cluster;
  __syncthreads();
}

// The same shared-memory address in CTA `rank` of the cluster.
__device__ __forceinline__ const float* RemoteShared(const float* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(const_cast<float*>(p), rank);
#else
  (void)rank;
  return p;
#endif
}

}  // namespace joa::gemv
