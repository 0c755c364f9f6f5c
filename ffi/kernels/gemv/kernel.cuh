// The weight-streaming GEMV engine: y[M, n_out] = epilogue(prologue(x)[M, K] W[n_rows, K]^T),
// M <= 32, W dense or n-bit, on mma.sync m16n8k16 with W as the A operand ("swap AB").
//
// Geometry (plan.h): warp (wn, wk) of a CTA owns the 16-row tile wn of each of the CTA's row blocks
// and the K chunks [c_begin, c_end) of its part (rank * warps_k + wk); the CTA loops over row blocks
// group, group + groups, ... A warp's work is a flat sequence of (row block, chunk) steps that it
// streams through its own cp.async ring of `stages` slots, across row-block boundaries too; each
// lane reads back only the W bytes it copied itself (n-bit scales / zero points are shared within
// the warp: a __syncwarp on each side of the read), so the ring needs no CTA barrier. x (this CTA's K
// slice) is staged once in shared memory in fragment order (stage.cuh). At the end of a row block
// each warp leaves its partial sums in shared memory; they are summed over warps_k, then
// (cluster > 1) across the cluster through distributed shared memory, in a fixed order (same
// inputs, same bits); the epilogue policy writes the outputs. No float atomics, no workspace.
//
// Programmatic dependent launch: the first `stages` chunks of W (and scales) are requested before
// griddepcontrol.wait (they must not be written by the kernel before this one, which holds for
// weights); x, gamma, bias and residual are read after it. Launched plainly (p.x_first), x's copies
// go before the ring's, so that its norm / permutation pass overlaps the first chunks' latency.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/gemv/cluster.cuh"
#include "kernels/gemv/epilogue.cuh"
#include "kernels/gemv/params.h"
#include "kernels/gemv/plan.h"
#include "kernels/gemv/stage.cuh"
#include "kernels/gemv/weights.cuh"
#include "kernels/ptx.cuh"

namespace joa::gemv {

__device__ __forceinline__ void Add8(float (&v)[8], const float* src) {
  const float4 a = *reinterpret_cast<const float4*>(src);
  const float4 b = *reinterpret_cast<const float4*>(src + 4);
  v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w;
  v[4] += b.x; v[5] += b.y; v[6] += b.z; v[7] += b.w;
}

template <typename T, class Weights, int kNT, class Prologue, class Epilogue>
__global__ void __launch_bounds__(kThreads, 2) GemvKernel(const __grid_constant__ GemvParams p) {
  constexpr FormatInfo kF = Weights::kInfo;
  constexpr int kStageBytes = Weights::kStageBytes;
  using Chunk = typename Weights::Chunk;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* s_x = smem;
  float* s_red = reinterpret_cast<float*>(smem + p.x_bytes);  // [2][warps_k][M][red_stride]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rank = ClusterRank(p.cluster);
  const int group = int(blockIdx.x) / p.cluster;
  const int wn = warp % p.warps_n, wk = warp / p.warps_n;
  const int c_begin = (rank * p.warps_k + wk) * p.cpp;
  const int c_end = min(c_begin + p.cpp, p.kc);
  const int slice0 = rank * p.slice_chunks;
  const int my_blocks = (p.blocks - group + p.groups - 1) / p.groups;  // >= 1: groups <= blocks
  const int steps = my_blocks * p.cpp;  // the same for every warp of the cluster
  unsigned char* ring = smem + p.ring_offset + warp * p.stages * kStageBytes;
  const typename Weights::Lane wl = Weights::MakeLane(p, lane);  // the lane's chunk-invariant offsets

  // The next kernel (if launched as a programmatic dependent) may start its own weight stream.
  ptx::LaunchDependents();

  // Step i = (row block iteration i / cpp, chunk c_begin + i % cpp) into slot i % stages; one
  // commit group per step, empty past the end or past the part's last chunk. Steps are issued in
  // order, so a cursor replaces the division (it was a fifth of the loop's instructions).
  int iss_step = 0, iss_it = 0, iss_j = 0, iss_slot = 0;
  auto issue_next = [&]() {
    const int c = c_begin + iss_j;
    if (iss_step < steps && c < c_end) {
      const int row = (group + iss_it * p.groups) * p.rows_block + wn * 16 + g;
      Weights::Issue(ring + iss_slot * kStageBytes, p, wl, row, c);
    }
    CpAsyncCommit();
    ++iss_step;
    iss_slot = iss_slot + 1 == p.stages ? 0 : iss_slot + 1;
    if (++iss_j == p.cpp) {
      iss_j = 0;
      ++iss_it;
    }
  };
  if (p.x_first) {
    // Not a programmatic dependent (the wait returns at once): x's group first, then the ring's;
    // the finishing pass waits for x's group only.
    ptx::WaitForPrimary();
    StageXIssue<T, Weights, Prologue>(p, smem, slice0, tid);
    for (int i = 0; i < p.stages; ++i) issue_next();
    StageXFinish<T, Weights, Prologue>(p, smem, slice0, tid, p.stages);
  } else {
    for (int i = 0; i < p.stages; ++i) issue_next();
    ptx::WaitForPrimary();  // x, gamma, bias, residual may come from the previous kernel
    StageXIssue<T, Weights, Prologue>(p, smem, slice0, tid);
    StageXFinish<T, Weights, Prologue>(p, smem, slice0, tid, 0);
  }
  __syncthreads();

  // The x row each lane's B fragment of n8 tile j reads (rows past M repeat row M - 1: their
  // products land in accumulator columns that are never stored). Tiles j < kNT / 2 are whole (M >
  // 8 (kNT / 2)): their offsets are the first's plus a constant, one register fewer each.
  int x_row_off[kNT];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    x_row_off[j] = (j < kNT / 2 ? 8 * j + g : min(8 * j + g, p.m - 1)) * 64 + 16 * t;
  }

  float acc[kNT][4];
  int it = 0, j = 0, slot = 0;  // row block iteration, chunk of the part, ring slot of step i
  for (int i = 0; i < steps; ++i) {
    if (j == 0) {
#pragma unroll
      for (int n = 0; n < kNT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    }
    // Step i's group has landed: groups so far are the ring's first `stages` and x's (in either
    // order; x's complete), then one per step: step i's is the (i + 2)-th at most.
    CpAsyncWaitPending(p.stages - 1);
    // n-bit: a lane reads scales / zero points that lanes 0 .. 3 nb - 1 copied, so their copies
    // must be visible to the whole warp (and, below, every lane done reading before they refill).
    if constexpr (Weights::kBits != 16) __syncwarp();
    const int c = c_begin + j;
    const int block = group + it * p.groups;
    if (c < c_end) {
      const unsigned char* xs = s_x + (c - slice0) * kF.quads * p.m * 64;
      // The chunk in kReads parts (pieces of a wide n-bit lane), each feeding kReadQuads quads.
      constexpr int kReadQuads = kF.quads / Weights::kReads;
#pragma unroll
      for (int r = 0; r < Weights::kReads; ++r) {
        const Chunk ch = Weights::Read(ring + slot * kStageBytes, p, wl, r);
#pragma unroll
        for (int qi = 0; qi < kReadQuads; ++qi) {
          const int q = r * kReadQuads + qi;
          uint32_t a[2][4];
          Weights::Fragments(ch, qi, a);
#pragma unroll
          for (int n = 0; n < kNT; ++n) {
            const uint4 xv = *reinterpret_cast<const uint4*>(xs + q * p.m * 64 + x_row_off[n]);
            ptx::Mma16816<T>(acc[n], a[0], xv.x, xv.y);
            ptx::Mma16816<T>(acc[n], a[1], xv.z, xv.w);
          }
        }
      }
    }
    if constexpr (Weights::kBits != 16) __syncwarp();
    issue_next();  // step i + stages: refills the slot just read (its values are in registers)
    slot = slot + 1 == p.stages ? 0 : slot + 1;
    if (++j < p.cpp) continue;
    j = 0;

    // End of a row block: partial sums -> s_red[parity][wk][m][row] (accumulator c0, c1 are
    // (row g, x rows 2t, 2t + 1), c2, c3 the same for row g + 8).
    const int rs = p.red_stride;
    float* red = s_red + (it & 1) * p.warps_k * p.m * rs;
    ++it;
    float* mine = red + wk * p.m * rs;
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = 8 * n + 2 * t + e;
        if (m < p.m) {
          mine[m * rs + wn * 16 + g] = acc[n][e];
          mine[m * rs + wn * 16 + g + 8] = acc[n][2 + e];
        }
      }
    }
    __syncthreads();
    const int groups8 = Epilogue::OutCols(p.rows_block) / 8;  // 8-output units per x row
    const int units = p.m * groups8;
    if (p.cluster == 1) {
      for (int unit = tid; unit < units; unit += kThreads) {
        const int m = unit / groups8, oc = (unit % groups8) * 8;
        Epilogue::template Apply<T>(p, m, block, oc, [&](int r0, float (&v)[8]) {
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = 0.f;
          for (int w = 0; w < p.warps_k; ++w) Add8(v, red + (w * p.m + m) * rs + r0);
        });
      }
      continue;
    }
    // Cluster: sum over warps_k into slot 0, then every CTA reads slot 0 of all ranks in rank order.
    const int vecs = p.m * (p.rows_block / 4);
    for (int v4 = tid; v4 < vecs; v4 += kThreads) {
      const int m = v4 / (p.rows_block / 4), r = (v4 % (p.rows_block / 4)) * 4;
      float4 sum = *reinterpret_cast<const float4*>(red + m * rs + r);
      for (int w = 1; w < p.warps_k; ++w) {
        const float4 o = *reinterpret_cast<const float4*>(red + (w * p.m + m) * rs + r);
        sum.x += o.x; sum.y += o.y; sum.z += o.z; sum.w += o.w;
      }
      *reinterpret_cast<float4*>(red + m * rs + r) = sum;
    }
    ClusterSync(p.cluster);
    for (int unit = rank * kThreads + tid; unit < units; unit += p.cluster * kThreads) {
      const int m = unit / groups8, oc = (unit % groups8) * 8;
      Epilogue::template Apply<T>(p, m, block, oc, [&](int r0, float (&v)[8]) {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = 0.f;
        // Four remote reads in flight at a time, summed in rank order.
        for (int r = 0; r < p.cluster; r += 4) {
          float4 lo[4], hi[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (r + e < p.cluster) {
              const float* src = RemoteShared(red + m * rs + r0, r + e);
              lo[e] = *reinterpret_cast<const float4*>(src);
              hi[e] = *reinterpret_cast<const float4*>(src + 4);
            }
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (r + e < p.cluster) {
              v[0] += lo[e].x; v[1] += lo[e].y; v[2] += lo[e].z; v[3] += lo[e].w;
              v[4] += hi[e].x; v[5] += hi[e].y; v[6] += hi[e].z; v[7] += hi[e].w;
            }
          }
        }
      });
    }
  }
  CpAsyncWaitPending(0);  // no copy may land after the CTA is gone (they are all empty by now)
  if (p.cluster > 1) ClusterSync(p.cluster);  // no CTA exits while another reads its partials
}

}  // namespace joa::gemv
