// The split combine done inside the split kernel, through distributed shared memory (sm_90+).
//
// When the splits of one (batch row, KV head, M block) are launched as one thread-block cluster,
// each CTA leaves its normalised partial O [kBlockM, kD] and log2-sum-exp [kBlockM] in its own
// shared memory; after a cluster barrier every CTA reads the others' partials directly (no
// workspace round trip through L2, no second kernel launch) and writes a share of the outputs.
// Same arithmetic as DecodeCombineKernel: M = max(max_s lse_s, sink), w_s = 2^(lse_s - M),
// out = sum_s w_s O_s / (sum_s w_s + 2^(sink - M)), splits summed in index order: deterministic; a
// NaN lse or sink makes the row NaN.
// It pays at small batch, where the combine kernel's launch and L2 round trips are most of a call.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include <cooperative_groups.h>
#endif

#include "kernels/common/variant.cuh"
#include "kernels/convert.cuh"
#include "kernels/decode/params.h"
#include "kernels/decode/plan.h"
#include "kernels/ptx.cuh"

namespace joa::decode {

// Called by every thread of every CTA of the cluster after its partials are in s_part (rows
// R = row0 + r < p.rows written, others ignored). Contains two cluster barriers: no thread may skip it.
// kThreads threads do the work; a CTA of kLaunchThreads > kThreads (the decode engine's producer
// warp) has the others take the barriers only.
template <typename T, int kD, int kBlockM, int kThreads, int kLaunchThreads = kThreads>
__device__ __forceinline__ void ClusterCombine(const DecodeParams& p, float* s_part, int b, int kvh,
                                               int row0, int tid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int n = int(cluster.num_blocks());
  const int rank = int(cluster.block_rank());
  float* s_lse = s_part + kBlockM * kD;
  float* s_w = s_lse + kBlockM;  // [kBlockM][kMaxClusterSplits]: w_s / denominator
  cluster.sync();                // every split's partials are visible

  if (tid < kBlockM && row0 + tid < p.rows) {
    const int R = row0 + tid;
    const int h = kvh * p.group + R / p.q_len;
    float lse[kMaxClusterSplits];
    const float sink = SinkLog2(p.variant.sink, h);
    float mx = sink;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      lse[s] = s < n ? cluster.map_shared_rank(s_lse, s)[tid] : -INFINITY;
      mx = ptx::MaxNan(mx, lse[s]);  // a poisoned split (NaN lse) poisons the row
    }
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      lse[s] = mx == -INFINITY ? 0.f : ptx::Exp2(lse[s] - mx);  // no key anywhere: all weights 0
      sum += lse[s];
    }
    if (sink != -INFINITY) sum += ptx::Exp2(sink - mx);
    const float inv = sum == 0.f ? 0.f : 1.f / sum;  // NaN stays NaN
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) s_w[tid * kMaxClusterSplits + s] = lse[s] * inv;
  }
  __syncthreads();

  // The block's (row, 4 columns) outputs, dealt round-robin over the cluster's CTAs.
  constexpr int kD4 = kD / 4;
  const int first = kLaunchThreads == kThreads || tid < kThreads ? rank * kThreads + tid : kBlockM * kD4;
  for (int idx = first; idx < kBlockM * kD4; idx += n * kThreads) {
    const int r = idx / kD4, d = (idx % kD4) * 4;
    const int R = row0 + r;
    if (R >= p.rows) continue;
    // Every remote read is issued before the first is used: one DSMEM round trip, not n in a
    // chain (at 16 splits the chain was a few µs of a B=1 call).
    float4 x[kMaxClusterSplits];
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      if (s < n) x[s] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(s_part, s) + r * kD + d);
    }
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      const float w = s < n ? s_w[r * kMaxClusterSplits + s] : 0.f;
      if (w == 0.f) continue;  // a split that saw no key (or past the cluster)
      acc.x += w * x[s].x; acc.y += w * x[s].y; acc.z += w * x[s].z; acc.w += w * x[s].w;
    }
    const int h = kvh * p.group + R / p.q_len, i = R % p.q_len;
    StoreVec4(static_cast<T*>(p.out) + b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_s + d, acc);
  }
  cluster.sync();  // no CTA exits while another still reads its shared memory
#endif
}

}  // namespace joa::decode
