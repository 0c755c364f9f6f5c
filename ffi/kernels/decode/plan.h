// The decode engine's limits, layouts and split plan: the one definition, host-only C++ (no CUDA
// headers), so the nanobind module exports it in every build (jax_onnx_attn._ffi.decode_plan /
// .limits; ops/cuda.py asks instead of re-deriving) and the engine takes its tiling from it
// (EngineConfig in engine.cuh).
//
// A plan is a pure function of static shapes and of whether the GPU runs thread-block clusters, so a
// call shape always gets the same splits, hence the same bits, on any GPU. Like FlashInfer's
// DecodePlan, but computed once at trace time, with no device query beyond the cluster flag.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/common/params.h"

namespace joa::decode {

// Split sizes are multiples of this many KV rows (and so of every engine tile size).
inline constexpr int kBlockN = 64;
// Most splits a call may have (DecodeCombineKernel's per-warp weights in shared memory).
inline constexpr int kMaxSplits = 256;
// Most splits combined inside one thread-block cluster (cluster_combine.cuh). Clusters over 8 CTAs
// are sm_90's non-portable sizes (opted into at launch).
inline constexpr int kMaxClusterSplits = 16;
// Head dims the engine is compiled for.
inline constexpr int kHeadDims[] = {64, 80, 96, 128, 256};
// CTA slots the split planner aims to fill: an H200's 132 SMs. A constant, not a device query.
inline constexpr int kPlanSms = 132;
// Shared memory a CTA may use when two (kBudget2) or one (kBudget1) share an SM: 228 KB per SM,
// 1 KB reserved per CTA.
inline constexpr int kBudget2 = 115712, kBudget1 = 232448;

// The cluster plans, tried in order: (cluster size, most KV tiles a split may stream). Measured on
// the H200 (bench/results/2026-11-30-decode-notes.md), B=1 32/8 d128 against split + combine
// kernel: 1k as 8 splits of 2 tiles 11.2 -> 7.8-8.6 us; 4k as 16 splits of 4 tiles 18.3 -> 14.1 us;
// 8k as 16 splits of 8 tiles 22.9 -> 20.7 us; but 8 splits of 8 tiles were slower (4k 20.0 vs
// 17.7 us): few CTAs each streaming many tiles leave the bandwidth of the other SMs unused.
struct ClusterPlan {
  int size, max_tiles;
};
inline constexpr ClusterPlan kClusterPlans[] = {{8, 2}, {16, 4}, {16, 8}};

constexpr bool SupportedHeadDim(int d) {
  for (int x : kHeadDims) {
    if (x == d) return true;
  }
  return false;
}

// Packed rows per CTA for a row count: 16 (4 warps splitting each KV tile), 32 (2 x 2), 64 (4 x 1)
// or 128 (8 x 1, more M blocks beyond).
constexpr int BlockRows(int64_t rows) { return rows <= 16 ? 16 : rows <= 32 ? 32 : rows <= 64 ? 64 : 128; }
constexpr int WarpsM(int block_rows) { return block_rows / 16; }
constexpr int WarpsN(int block_rows) { return block_rows == 16 ? 4 : block_rows == 32 ? 2 : 1; }

// f32 elements of a CTA's cluster area: partial O [block_m, d], lse [block_m], weights
// [block_m, kMaxClusterSplits].
constexpr int ClusterPartFloats(int block_m, int d) { return block_m * d + block_m + block_m * kMaxClusterSplits; }

// The static tiling of one engine layout: head dim d, kWarpsM x kWarpsN warps, elements of
// elem_bytes (Q and the tiles the MMAs read), a cache of kv_bits per value (0: dense elements).
struct Layout {
  int warps, threads, block_m;
  int tile_n;       // KV rows per stage: 64 when several warps split a tile, else 32
  int warp_n;       // KV columns of a tile per warp
  int chunk;        // columns per softmax update
  bool q_in_regs;   // Q fragments in registers (up to d128; re-read from shared memory at d256)
  int stride;       // shared-memory row stride of Q and the tiles (rows padded by 16 bytes)
  int o_stride;     // f32 merge rows, padded likewise
  int q_bytes, tile_elems;
  int stage_bytes;  // a ring stage: a K and a V tile as the cache stores them
  int conv_bytes;   // quantised: the converted T tile pair and the K / V scales
  int ring_offset, merge_bytes;
  int stages, ctas_per_sm;
  int pipe_bytes, smem_bytes;
  bool cluster_combine;  // the in-cluster combine fits (16-row blocks only)
};

constexpr Layout MakeLayout(int d, int warps_m, int warps_n, int elem_bytes, int kv_bits) {
  Layout l{};
  const bool quantized = kv_bits != 0;
  l.warps = warps_m * warps_n;
  l.threads = 32 * l.warps;
  l.block_m = 16 * warps_m;
  // Small stages when one warp takes a whole tile, so that more of them fit: decode is bound by
  // the KV bytes in flight.
  l.tile_n = warps_n > 1 ? 64 : 32;
  l.warp_n = l.tile_n / warps_n;
  l.chunk = l.warp_n < 32 ? l.warp_n : 32;
  // At d256 Q in registers would push the O accumulators (128 registers) into spills.
  l.q_in_regs = d <= 128;
  // Consecutive rows start 4 banks apart, so ldmatrix is conflict-free.
  l.stride = d + 8;
  l.o_stride = d + 8;
  l.q_bytes = l.block_m * l.stride * elem_bytes;
  l.tile_elems = l.tile_n * l.stride;
  l.stage_bytes = quantized ? 2 * l.tile_n * d * kv_bits / 8 : 2 * l.tile_elems * elem_bytes;
  l.conv_bytes = quantized ? 2 * l.tile_elems * elem_bytes + 2 * d * 4 : 0;
  l.ring_offset = l.q_bytes + l.conv_bytes;
  l.merge_bytes = l.warps * 16 * (l.o_stride + 2) * 4;
  // Stages from the shared-memory budget: as many as fit two CTAs per SM, or one CTA when that
  // keeps half again as many tiles in flight (or two do not fit).
  const int fit2 = (kBudget2 - l.ring_offset) / l.stage_bytes;
  const int fit1 = (kBudget1 - l.ring_offset) / l.stage_bytes;
  const int stages2 = fit2 < 8 ? fit2 : 8;
  const int stages1 = fit1 < 8 ? fit1 : 8;
  const bool two = l.threads <= 128 && stages2 >= 2 && 3 * (stages2 - 1) >= stages1 - 1 &&
                   l.q_bytes + l.merge_bytes <= kBudget2;
  l.ctas_per_sm = two ? 2 : 1;
  l.stages = two ? stages2 : stages1;
  l.pipe_bytes = l.stages * l.stage_bytes;
  // The merge reuses everything past Q once the loop is done.
  l.smem_bytes = l.q_bytes + (l.conv_bytes + l.pipe_bytes > l.merge_bytes ? l.conv_bytes + l.pipe_bytes
                                                                           : l.merge_bytes);
  // The in-cluster combine keeps its partials after the merge area.
  l.cluster_combine = l.block_m == 16 && l.q_bytes + l.merge_bytes + ClusterPartFloats(l.block_m, d) * 4 <= l.smem_bytes;
  return l;
}

// The layout the launcher picks for `rows` packed rows (16-bit Q, the engine's only element types).
constexpr Layout LayoutFor(int64_t rows, int d, KvFormat format) {
  const int block = BlockRows(rows);
  return MakeLayout(d, WarpsM(block), WarpsN(block), 2, KvBits(format));
}

// f32 elements of the workspace: normalised partial outputs [B, Hkv, splits, M, D] then their
// log2-sum-exps [B, Hkv, splits, M]; nothing with one split or a cluster combine.
constexpr int64_t WorkspaceElems(int64_t batch, int64_t kv_heads, int64_t splits, int64_t rows, int64_t d) {
  return splits > 1 ? batch * kv_heads * splits * rows * (d + 1) : 0;
}

// KV rows per split without a cluster: with enough (batch, KV head, M block) CTAs to fill the GPU
// one split (no combine); otherwise the fewest splits whose wave efficiency is within 85% of the
// best (the FA3 heuristic), each split a whole number of tiles.
inline int64_t SplitRows(int64_t batch, int64_t kv_heads, int64_t rows, int64_t capacity, int d,
                         KvFormat format) {
  const int block = BlockRows(rows);
  const int64_t ctas = batch * kv_heads * ((rows + block - 1) / block);
  const int64_t tiles = std::max<int64_t>(1, (capacity + kBlockN - 1) / kBlockN);
  const int64_t slots = int64_t(kPlanSms) * LayoutFor(rows, d, format).ctas_per_sm;
  if (double(ctas) >= 0.8 * double(slots)) return tiles * kBlockN;
  auto efficiency = [&](int64_t n) {
    const int64_t work = ctas * n;
    return double(work) / double(((work + slots - 1) / slots) * slots);
  };
  double best = 0.0;
  for (int64_t per_split = 1; per_split <= tiles; ++per_split) {
    const int64_t n = (tiles + per_split - 1) / per_split;
    if (n <= kMaxSplits) best = std::max(best, efficiency(n));
  }
  int64_t chosen_n = -1, chosen = tiles;
  for (int64_t per_split = 1; per_split <= tiles; ++per_split) {
    const int64_t n = (tiles + per_split - 1) / per_split;
    if (n > kMaxSplits || efficiency(n) < 0.85 * best) continue;
    if (chosen_n < 0 || n < chosen_n) {
      chosen_n = n;
      chosen = per_split;
    }
  }
  return chosen * kBlockN;
}

// KV rows per split when the splits should combine inside a thread-block cluster, or 0: for 16-row
// blocks (decode at small batch) of a layout that has the cluster combine, the first of
// kClusterPlans whose cluster (capped by the tiles and by the CTA slots of this layout) cuts the
// context into splits short enough.
inline int64_t ClusterSplitRows(int64_t batch, int64_t kv_heads, int64_t rows, int64_t capacity, int d,
                                KvFormat format) {
  const Layout l = LayoutFor(rows, d, format);
  if (l.block_m != 16 || !l.cluster_combine) return 0;
  const int64_t ctas = std::max<int64_t>(batch * kv_heads, 1);
  const int64_t tiles = std::max<int64_t>(1, (capacity + kBlockN - 1) / kBlockN);
  const int64_t slots = int64_t(kPlanSms) * l.ctas_per_sm;
  for (const ClusterPlan& plan : kClusterPlans) {
    const int64_t n = std::min<int64_t>({plan.size, tiles, slots / ctas});
    if (n >= 2 && (tiles + n - 1) / n <= plan.max_tiles) return (tiles + n - 1) / n * kBlockN;
  }
  return 0;
}

// A call's plan: what the handler is told (split_rows, cluster) and the workspace Python sizes.
struct Plan {
  int64_t split_rows;
  int64_t splits;
  bool cluster;             // the splits combine inside one thread-block cluster
  int64_t workspace_elems;  // f32 elements of the workspace output (>= 1: XLA wants a buffer)
  int block_rows;
  int ctas_per_sm;
};

// split_rows: 0 lets the planner choose, else a positive multiple of kBlockN (the caller checks).
// cluster: -1 lets the planner choose (only with split_rows 0: cluster plans are measured for
// dense caches on GPUs that run clusters), 0 never, 1 whenever there are several splits.
inline Plan MakePlan(int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t q_len, int64_t capacity,
                     int d, KvFormat format, bool cluster_capable, int64_t split_rows, int cluster) {
  const int64_t rows = (q_heads / std::max<int64_t>(kv_heads, 1)) * q_len;
  bool use_cluster = cluster == 1;
  if (cluster < 0) {
    const int64_t cluster_rows = split_rows == 0 && format == KvFormat::kDense && cluster_capable
                                     ? ClusterSplitRows(batch, kv_heads, rows, capacity, d, format)
                                     : 0;
    use_cluster = cluster_rows > 0;
    if (use_cluster) split_rows = cluster_rows;
  }
  if (split_rows == 0) split_rows = SplitRows(batch, kv_heads, rows, capacity, d, format);
  Plan p{};
  p.split_rows = split_rows;
  p.splits = (capacity + split_rows - 1) / split_rows;
  p.cluster = use_cluster && p.splits > 1;
  p.workspace_elems = p.cluster ? 1 : std::max<int64_t>(1, WorkspaceElems(batch, kv_heads, p.splits, rows, d));
  p.block_rows = BlockRows(rows);
  p.ctas_per_sm = LayoutFor(rows, d, format).ctas_per_sm;
  return p;
}

}  // namespace joa::decode
