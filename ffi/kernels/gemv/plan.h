// The weight-streaming GEMV engine's launch plan: a pure function of static shapes, the one place
// where its geometry is decided. Plain C++ (no CUDA headers) so that the nanobind module can export
// it to Python (jax_onnx_attn._ffi.gemv_plan) for routing and for the benchmarks.
//
// The engine computes y[M, N] = x[M, K] W[N, K]^T for M <= 32 with the weight as the MMA A
// operand: a warp owns a 16-row tile of W and a contiguous range of K "chunks" (4 lanes x 32 bytes
// of each of its 16 rows dense and n-bit wide, 4 x 16 n-bit: 2 or 1 KB of W a chunk). It streams
// its chunks through its own cp.async ring of `stages` slots in shared memory. A CTA of kWarps warps is warps_n row tiles x warps_k K parts; the
// CTAs of a thread-block cluster (sm_90) split K once more. x's share of K is staged once per CTA
// in shared memory, in the order the MMA fragments read it (with the RMS-norm prologue, its slice of
// gamma too). CTAs loop over row blocks
// (persistent): block b, b + groups, ... Partial sums are reduced in shared memory (warps_k), then
// across the cluster through distributed shared memory, always in the same order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace joa::gemv {

inline constexpr int kWarps = 8;                 // warps per CTA
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kMaxM = 32;                 // rows of x the engine takes (4 n8 MMA tiles)
inline constexpr int kMinStages = 2, kMaxStages = 8;  // ring slots (chunks in flight) per warp
inline constexpr int kMaxCluster = 16;
// Rows per tile of the n-bit scales / zero points ([ceil(N / 16), k_blocks, 16]: a warp's row tile).
inline constexpr int kMetaTileRows = 16;
// The record layout of one-row 4-bit weights (slots.cuh's RecordFormat,
// jax_onnx_attn.ops.linear.to_record_layout): uint8 [N / kRecordRows, K / kRecordK, kRecordBytes],
// one record per (16-row tile, 256-k chunk of the wide format): the chunk's W in lane order, then
// the lanes' scales and zero points (3 words a lane).
inline constexpr int kRecordRows = 16;
inline constexpr int kRecordK = 256;
inline constexpr int kRecordWBytes = kRecordRows * kRecordK / 2;  // 2048
inline constexpr int kRecordMetaBytes = 3 * 4 * 32;                // 384
inline constexpr int kRecordBytes = kRecordWBytes + kRecordMetaBytes;
// CTA slots the planner fills: an H200's 132 SMs. A constant, not a device query, so one call
// shape always gets the same plan, hence the same bits.
inline constexpr int kPlanSms = 132;
// Shared memory per CTA when two CTAs share an SM, and for one CTA: sm_90 (228 KB per SM, 1 KB
// reserved per CTA; the decode engine's kBudget2 / kBudget1) and sm_80 (164 KB per SM, at most
// 163 KB a CTA).
inline constexpr int64_t kSmemTwoPerSm = 115712;
inline constexpr int64_t kSmemOnePerSm = 232448;
inline constexpr int64_t kSmemTwoPerSm80 = 82944;
inline constexpr int64_t kSmemOnePerSm80 = 166912;
// RMS norm: per x row, this CTA's f32 sum of squares and the inverse RMS.
inline constexpr int64_t kNormBytes = 2 * 4 * kMaxM;

// Weight formats by bits per element: 16 (dense f16 / bf16), 8 or 4 (MatMulNBits). A lane copies
// `pieces` 16-byte pieces of each of its two rows per chunk (piece_k = 128 / bits elements each):
// piece p of lane t holds elements piece_stride p + lane_stride t .. + piece_k - 1 of the chunk
// (piece_stride = 4 piece_k = 64 bytes), so that each copy instruction of a warp reads whole 64-byte
// runs of 8 rows (lane-contiguous pieces would split every 32-byte sector between two
// instructions). Quad q (8 x values, feeding two k16 MMA steps) of a lane is the 8 elements from
// QuadK(q) = piece_stride (q / piece quads) + quad_stride (q % piece quads) past its first.
//   dense:        two pieces (elements 8 t and 32 + 8 t), 2 quads: 128 bytes a row per chunk;
//   n-bit:        one piece (its 16 packed bytes: 32 int4 / 16 int8 elements), 4 / 2 quads: 64 bytes;
//   n-bit wide:   two pieces (elements lane_stride t and 4 lane_stride + lane_stride t), 8 / 4
//                 quads: 128 bytes a row per chunk, as dense. Twice the bytes per chunk halve the
//                 per-chunk overhead (copy issue, ring wait, address math, loop control) per byte.
struct FormatInfo {
  int quads;         // 16-byte x quads per lane per chunk
  int lane_k;        // K elements one lane covers per chunk (8 * quads)
  int chunk_k;       // K elements per chunk (4 lanes)
  int lane_stride;   // K offset of lane t's first element in a chunk: lane_stride * t (= piece_k)
  int quad_stride;   // K offset of quad q from the start of its piece: quad_stride * (q % piece quads)
  int pieces;        // 16-byte pieces of W a lane copies per row per chunk
  int piece_stride;  // K offset of piece p from the lane's first element: piece_stride * p
};

inline constexpr FormatInfo Format(int bits, bool wide = false) {
  const int pieces = bits == 16 || wide ? 2 : 1;
  const int piece_k = 128 / bits;
  const int lane_k = pieces * piece_k;
  return FormatInfo{lane_k / 8, lane_k, 4 * lane_k, piece_k, 8, pieces, 4 * piece_k};
}

// K offset of quad q of a lane from the lane's first element (see FormatInfo).
inline constexpr int QuadK(FormatInfo f, int q) {
  const int per_piece = f.quads / f.pieces;
  return f.piece_stride * (q / per_piece) + f.quad_stride * (q % per_piece);
}

// n8 MMA tiles over x's rows: 1, 2 or 4 (M <= 8, 16, 32).
inline constexpr int TilesM(int64_t m) { return m <= 8 ? 1 : m <= 16 ? 2 : 4; }

// The warp layouts a CTA may take: (row tiles, K parts), warps_n * warps_k = kWarps.
inline constexpr int kLayouts[4][2] = {{8, 1}, {4, 2}, {2, 4}, {1, 8}};

// W bytes of one chunk (what the HBM stream carries, scales aside): 16 rows x 4 lanes x pieces x 16.
inline constexpr int ChunkWeightBytes(int bits, bool wide = false) {
  return 1024 * Format(bits, wide).pieces;
}
// Quantisation blocks one n-bit chunk spans at most: blocks are at least a piece long (the handler
// checks block_size >= piece_k), so 4 (one piece a lane) or 8 (two).
inline constexpr int MaxChunkBlocks(int bits, bool wide) { return 4 * Format(bits, wide).pieces; }
// Bytes of one ring slot of a warp: a chunk of W, and for n-bit weights the tile's scales (32 bytes
// a block) and zero points (16) of the chunk's blocks, one 16-byte copy per lane (weights.cuh):
// 512 bytes reserved in the one-piece format (a slot per lane), 8 x 48 in the wide one.
inline constexpr int StageBytes(int bits, bool wide = false) {
  return ChunkWeightBytes(bits, wide) + (bits == 16 ? 0 : wide ? 48 * MaxChunkBlocks(bits, wide) : 512);
}

// Cost model constants behind the choice among plans (to be tuned on the GPU with
// `python -m jax_onnx_attn.bench linear --sweep`). Achievable HBM GB/s; the latency a chunk waits
// under load; per-SM L2 -> SM GB/s for staging x; fixed cost of one row block's reduction, plus
// the cluster barrier. A warp keeps stages - 1 to stages chunks in flight.
inline constexpr double kModelHbmGbs = 4300.0;
inline constexpr double kModelLatencyUs = 1.2;
inline constexpr double kModelSmInflight = 40.0 * 1024;  // what one SM's memory pipeline keeps in flight
inline constexpr double kModelSmL2Gbs = 100.0;
// x read by many CTAs: each line of a CTA's x slice is read by every group (the CTAs of other
// clusters with the same slice), and many SMs asking L2 for the same lines at once is slow (H200
// probe, M = 8, 1B shapes, cluster 1: a private copy of x per CTA saved o 3.5 us, gate-up 3.1, LM
// head 6; with clusters of 16, i.e. 16 groups, nothing). With the cluster terms below, fitted to a
// sweep of every layout at M = 8 / 16 / 32 on ~1B and ~8B shapes
// (bench/results/2026-12-01-gemv-ring-layouts.json). Groups past one per SM count as one per SM
// (the LM head at M = 8 ran 68.6 us on 251 CTAs, 72.6 on 126).
inline constexpr double kModelXHotGbs = 2600.0;
inline constexpr double kModelBlockUs = 0.25;
// A cluster's reduction per row block: a fixed part and one per CTA (partials read through DSMEM,
// two cluster barriers). Refitted on the same sweep (0.75 / 0.1 from 1.0 / 0.05): the planned
// layouts' sum 1485 -> 1455 us, none slower (M = 32 8B qkv 53.8 -> 30.1, M = 16 o 10.1 -> 8.5).
inline constexpr double kModelClusterUs = 0.75;
inline constexpr double kModelClusterCtaUs = 0.1;

struct Plan {
  std::string error;  // empty when the engine takes this shape
  // One row of 4-bit wide weights on the slots kernel (slots.cuh) instead of the ring kernel: one
  // 16-row tile a CTA at a time, warps splitting K, W straight into registers, x multicast within
  // clusters of `cluster` CTAs (sm_90). Fields below then describe that kernel's geometry.
  bool slots = false;
  // One row of dense weights on the dense row kernel (dense_row.cuh): the slots kernel's geometry
  // (one 16-row tile a CTA at a time, warps splitting K, W straight into registers), no cluster.
  bool dense_row = false;
  // 4-bit weights in the rows layout on the rows kernel (rows.cuh; MakeRowsPlan): cluster = its K
  // split, warps_n = row groups (warps) a CTA, stages = W stages a warp has in flight, ctas_per_sm =
  // its occupancy (1 or 2: the kernel's register cap, RowsOccupancy2Fits), rows_block = the CTA's W
  // rows; x_bytes / red_bytes its x slice and partial sums (aliased), gamma_offset the norm's
  // statistics.
  bool rows = false;
  // One row of 4-bit weights in the record layout (MakeRecordPlan): the slots kernel's plan (slots
  // set too) reading records (slots.cuh's RecordFormat).
  bool record = false;
  int m = 0, n_rows = 0, n_out = 0, k = 0, bits = 16, nt = 1;
  bool wide = false;     // n-bit weights in the two-piece format (FormatInfo)
  int quads = 2, lane_k = 16, chunk_k = 64, lane_stride = 8, quad_stride = 8, pieces = 2, piece_stride = 32;
  int kc = 0;            // K chunks
  int cluster = 1;       // CTAs of a cluster, splitting K
  int warps_n = 1, warps_k = 8;
  int cpp = 0;           // chunks per K part (a warp's range)
  int stages = 0;        // ring slots per warp
  int stage_bytes = 0;
  int slice_chunks = 0;  // chunks of x a CTA stages (warps_k * cpp)
  int rows_block = 16;   // W rows per row block (16 * warps_n)
  int blocks = 0;        // row blocks
  int groups = 0;        // CTAs (clusters) that loop over the row blocks
  int grid = 0;          // groups * cluster
  int waves = 0;         // row blocks per group, at most
  int red_stride = 0;    // f32 per x row in a reduction buffer (rows_block + 4: no bank conflicts)
  int ctas_per_sm = 1;
  bool norm = false;
  // Shared memory: x stage | reduction buffers | norm statistics | gamma's slice | the warps' rings.
  int64_t x_bytes = 0, red_bytes = 0, gamma_offset = 0, ring_offset = 0, smem_bytes = 0;
  double est_us = 0.0;   // the cost model's estimate (for tuning; not a measurement)
};

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t Align16(int64_t a) { return (a + 15) / 16 * 16; }

// Fills the layout-dependent fields of `p` (shape fields set) for one (cluster, warps_n, warps_k,
// CTAs per SM) on sm_90 or older GPUs. False if it does not fit.
inline bool Layout(Plan& p, int cluster, int warps_n, int warps_k, int ctas_per_sm, bool sm90) {
  p.cluster = cluster;
  p.warps_n = warps_n;
  p.warps_k = warps_k;
  p.cpp = int(CeilDiv(p.kc, int64_t(cluster) * warps_k));
  p.slice_chunks = warps_k * p.cpp;
  p.rows_block = 16 * warps_n;
  p.red_stride = p.rows_block + 4;
  p.x_bytes = Align16(int64_t(p.m) * p.slice_chunks * p.chunk_k * 2);
  // Two buffers (alternate row blocks) of [warps_k][M][red_stride] partial sums.
  p.red_bytes = Align16(int64_t(2) * warps_k * p.m * p.red_stride * 4);
  p.gamma_offset = p.x_bytes + p.red_bytes + kNormBytes;
  p.ring_offset = p.gamma_offset + (p.norm ? Align16(int64_t(p.slice_chunks) * p.chunk_k * 2) : 0);
  p.stage_bytes = StageBytes(p.bits, p.wide);
  const int64_t budget = ctas_per_sm == 2 ? (sm90 ? kSmemTwoPerSm : kSmemTwoPerSm80)
                                          : (sm90 ? kSmemOnePerSm : kSmemOnePerSm80);
  const int64_t stages = (budget - p.ring_offset) / (int64_t(kWarps) * p.stage_bytes);
  if (stages < kMinStages) return false;
  p.stages = int(std::min<int64_t>(stages, kMaxStages));
  p.smem_bytes = p.ring_offset + int64_t(kWarps) * p.stages * p.stage_bytes;
  p.ctas_per_sm = ctas_per_sm;
  if (ctas_per_sm == 1 && cluster > 8) return false;  // 16 one-CTA SMs in a GPC: not guaranteed
  p.blocks = int(CeilDiv(p.n_rows, p.rows_block));
  const int slots = kPlanSms * ctas_per_sm;
  const int max_groups = std::max(1, slots / cluster);
  const int groups = std::min(p.blocks, max_groups);
  p.waves = int(CeilDiv(p.blocks, groups));
  p.groups = int(CeilDiv(p.blocks, p.waves));  // the same number of blocks for (almost) every group
  p.grid = p.groups * cluster;
  // Cost model: a warp streams waves * cpp chunks; all warps share the HBM bandwidth, and an SM
  // streams at most kModelSmInflight bytes per latency. The busiest SM sets the time: with 224 CTAs
  // on 132 SMs, 92 hold two and 40 one (ncu: a 235 MB weight at 0.72 of HBM, 1.7 CTAs an SM), so
  // the plan counts the CTAs of the busiest SM, not the average.
  const double chunk_bytes = ChunkWeightBytes(p.bits, p.wide);
  const double warp_bytes = double(p.waves) * p.cpp * chunk_bytes;
  const double cta_bytes = warp_bytes * kWarps;
  const int busiest = int(CeilDiv(p.grid, kPlanSms));  // CTAs on the busiest SM
  const double sm_inflight = std::min(kModelSmInflight, busiest * kWarps * (p.stages - 0.5) * chunk_bytes);
  const double sm_gbs = sm_inflight / (kModelLatencyUs * 1e3);
  const double stream_us = std::max(cta_bytes * p.grid / (kModelHbmGbs * 1e3),
                                    cta_bytes * busiest / (sm_gbs * 1e3));
  const double start_us = double(p.x_bytes) / (kModelSmL2Gbs * 1e3) +
                          double(std::min(p.groups, kPlanSms)) * p.x_bytes / (kModelXHotGbs * 1e3);
  const double block_us =
      p.waves * (kModelBlockUs + (cluster > 1 ? kModelClusterUs + kModelClusterCtaUs * cluster : 0.0));
  p.est_us = start_us + stream_us + block_us;
  return true;
}

// The slots kernel (slots.cuh): clusters of two CTAs share x (one L2 request a line for both:
// on the H200, a 4-8 KB x read by every one of 128-264 CTAs took 2-5 us to arrive; clusters of 2
// gave the best times on the ~1B shapes, 4 and 8 were slower where 264 CTAs could not all be
// resident as clusters), two CTAs an SM.
inline constexpr int kSlotsCluster = 2;

// The geometry the one-row kernels share (slots.cuh, dense_row.cuh): a CTA's kWarps warps split
// K of one 16-row tile at a time, persistent CTAs (clusters of `cluster`), two an SM, no ring.
inline void OneRowGeometry(Plan& p, int cluster, int red_stride) {
  p.cluster = cluster;
  p.warps_n = 1;
  p.warps_k = kWarps;
  p.cpp = int(CeilDiv(p.kc, kWarps));
  p.slice_chunks = p.kc;
  p.rows_block = 16;
  p.red_stride = red_stride;
  p.blocks = int(CeilDiv(p.n_rows, 16));
  p.grid = int(CeilDiv(std::min(p.blocks, 2 * kPlanSms), cluster) * cluster);
  p.groups = p.grid;
  p.waves = int(CeilDiv(p.blocks, p.grid));
  p.ctas_per_sm = 2;
  p.stages = 0;
  p.stage_bytes = 0;
  p.est_us = 0.0;  // not modelled: chosen by measurement
}

// Fills `p` (a MakePlan base of one row of 4-bit wide weights) for the slots kernel; false when
// its shared memory does not fit two CTAs an SM.
inline bool SlotsLayout(Plan& p, bool sm90) {
  p.slots = true;
  OneRowGeometry(p, sm90 ? kSlotsCluster : 1, 20);
  const int64_t x_area = int64_t(p.kc) * p.chunk_k * 2;
  p.x_bytes = x_area;
  p.red_bytes = Align16(int64_t(2) * kWarps * p.red_stride * 4);
  p.gamma_offset = p.x_bytes + p.red_bytes + kNormBytes;
  p.ring_offset = p.gamma_offset + (p.norm ? x_area : 0);
  // Then 512 zero bytes, f32 pairs per 32-element piece of K, x (and gamma) as in memory, a barrier
  // (slots.cuh's SlotsSmemBytes).
  p.smem_bytes = p.ring_offset + 512 + int64_t(p.kc) * 64 + x_area * (p.norm ? 2 : 1) + 16;
  return p.smem_bytes <= (sm90 ? kSmemTwoPerSm : kSmemTwoPerSm80);
}

// K elements a CTA's warps take together per step of the dense row kernel (64 each).
inline constexpr int64_t kDenseRowK = 64 * kWarps;

// Fills `p` (a MakePlan base of one row of dense weights, K % kDenseRowK == 0, 16-row tiles) for the
// dense row kernel; false when its shared memory (dense_row.cuh's DenseRowSmemBytes: x, a zero
// unit, two sets of the warps' 16 partial row sums, the norm's warp sums) does not fit two CTAs an SM.
inline bool DenseRowLayout(Plan& p, bool sm90) {
  p.dense_row = true;
  OneRowGeometry(p, 1, 16);
  p.x_bytes = int64_t(p.k) * 2;
  p.red_bytes = int64_t(2) * kWarps * 16 * 4;
  p.gamma_offset = p.ring_offset = 0;  // gamma is read from memory as x is staged
  p.smem_bytes = p.x_bytes + 16 + p.red_bytes + kWarps * 4;
  return p.smem_bytes <= (sm90 ? kSmemTwoPerSm : kSmemTwoPerSm80);
}

// The plan for y[m, n_out] = x[m, k] W^T with W of n_rows rows (n_out = n_rows / 2 when gated) and
// `bits` per weight element; norm: the RMS-norm prologue. sm90: the device is sm_90+ (thread-block clusters, 227 KB of shared
// memory a CTA); else the plan keeps to sm_80's limits and no clusters.
// force_cluster / force_warps_k > 0 restrict the choice (for sweeps); 0 lets the model choose.
// wide: n-bit weights in the two-piece format (ignored for dense weights, which always have two).
// slots: one row may take a one-row kernel when no layout is forced and it fits: 4-bit wide
// weights (block_size >= 32, dividing K) the slots kernel (slots.cuh), dense weights with
// K % kDenseRowK == 0 and N % 16 == 0 the dense row kernel (dense_row.cuh).
inline Plan MakePlan(int64_t m, int64_t n_rows, int64_t k, int bits, bool gated, bool norm, bool sm90,
                     int64_t force_cluster = 0, int64_t force_warps_k = 0, bool wide = false,
                     int64_t block_size = 0, bool slots = false) {
  Plan best;
  auto fail = [&](const std::string& why) {
    best.error = why;
    return best;
  };
  if (bits != 16 && bits != 8 && bits != 4) return fail("bits must be 16, 8 or 4");
  if (m < 1 || m > kMaxM) return fail("x must have 1 to " + std::to_string(kMaxM) + " rows");
  if (k < 8 || k % 8 != 0 || k > (int64_t(1) << 30)) return fail("K must be a positive multiple of 8");
  if (n_rows < 8 || n_rows % (gated ? 16 : 8) != 0 || n_rows > (int64_t(1) << 30)) {
    return fail(gated ? "gated W rows must be a positive multiple of 16"
                      : "N must be a positive multiple of 8");
  }
  if (force_cluster < 0 || force_cluster > kMaxCluster || (force_cluster & (force_cluster - 1))) {
    return fail("cluster must be 0 (planned) or a power of two up to 16");
  }
  if (force_warps_k < 0 || force_warps_k > kWarps || (force_warps_k & (force_warps_k - 1))) {
    return fail("warps_k must be 0 (planned), 1, 2, 4 or 8");
  }
  if (force_cluster > 1 && !sm90) return fail("thread-block clusters need sm_90 or newer");
  Plan base;
  base.m = int(m);
  base.n_rows = int(n_rows);
  base.n_out = int(gated ? n_rows / 2 : n_rows);
  base.k = int(k);
  base.bits = bits;
  base.norm = norm;
  base.nt = TilesM(m);
  base.wide = wide && bits != 16;
  const FormatInfo f = Format(bits, base.wide);
  base.quads = f.quads;
  base.lane_k = f.lane_k;
  base.chunk_k = f.chunk_k;
  base.lane_stride = f.lane_stride;
  base.quad_stride = f.quad_stride;
  base.pieces = f.pieces;
  base.piece_stride = f.piece_stride;
  base.kc = int(CeilDiv(k, f.chunk_k));
  if (slots && m == 1 && bits == 4 && base.wide && force_cluster == 0 && force_warps_k == 0 &&
      block_size >= 32 && k % block_size == 0) {
    Plan p = base;
    if (SlotsLayout(p, sm90)) return p;
  }
  if (slots && m == 1 && bits == 16 && force_cluster == 0 && force_warps_k == 0 && k % kDenseRowK == 0 &&
      n_rows % 16 == 0) {
    Plan p = base;
    if (DenseRowLayout(p, sm90)) return p;
  }
  bool found = false, too_few_chunks = false;
  for (int cluster = 1; cluster <= (sm90 ? kMaxCluster : 1); cluster *= 2) {
    if (force_cluster > 0 && cluster != force_cluster) continue;
    for (const auto& layout : kLayouts) {
      if (force_warps_k > 0 && layout[1] != force_warps_k) continue;
      // Every K part gets a chunk, unless a sweep forces the layout.
      if (int64_t(cluster) * layout[1] > base.kc && (force_cluster == 0 || force_warps_k == 0)) {
        too_few_chunks = true;
        continue;
      }
      for (int ctas_per_sm = 2; ctas_per_sm >= 1; --ctas_per_sm) {
        Plan p = base;
        if (!Layout(p, cluster, layout[0], layout[1], ctas_per_sm, sm90)) continue;
        // Ties (within 1%) go to the fewer K parts: fewer reductions and cluster barriers.
        if (!found || p.est_us < 0.99 * best.est_us) {
          best = p;
          found = true;
        }
      }
    }
  }
  if (!found && too_few_chunks && force_cluster > 0) {
    return fail("cluster " + std::to_string(force_cluster) + " splits K into more parts than its " +
                std::to_string(base.kc) + " chunks of " + std::to_string(f.chunk_k) +
                " elements (use a smaller cluster, or 0 to let the plan choose)");
  }
  if (!found) {
    return fail("x's share of K does not fit in shared memory (M * K too large" +
                std::string(sm90 ? "" : " below sm_90 (no clusters)") + ")");
  }
  return best;
}

// The plan of one row of x against 4-bit weights in the record layout: the slots kernel's plan
// (the same geometry, so the same sums in the same order: the slots kernel's bits), with
// plan.record set. The layout needs N % kRecordRows == 0 and K % kRecordK == 0 (whole records),
// block_size a power of two >= 32 dividing K; M > 1 has no kernel (the caller runs the reference).
inline Plan MakeRecordPlan(int64_t m, int64_t n_rows, int64_t k, int64_t block_size, bool gated, bool norm,
                           bool sm90) {
  Plan p;
  auto fail = [&](const std::string& why) {
    p = Plan{};
    p.error = "record layout: " + why;
    return p;
  };
  if (m != 1) return fail("one row of x only (the slots kernel), got " + std::to_string(m));
  if (block_size < 32 || block_size > (int64_t(1) << 20) || (block_size & (block_size - 1))) {
    return fail("block_size must be a power of two >= 32");
  }
  if (k < kRecordK || k % kRecordK != 0 || k % block_size != 0 || k > (int64_t(1) << 30)) {
    return fail("K must be a positive multiple of " + std::to_string(kRecordK) + " and of block_size");
  }
  if (n_rows < kRecordRows || n_rows % kRecordRows != 0 || n_rows > (int64_t(1) << 30)) {
    return fail("N must be a positive multiple of " + std::to_string(kRecordRows));
  }
  p = MakePlan(1, n_rows, k, 4, gated, norm, sm90, 0, 0, /*wide=*/true, block_size, /*slots=*/true);
  if (!p.error.empty()) return fail(p.error);
  if (!p.slots) return fail("the slots kernel's shared memory does not take x's K (" + std::to_string(k) + ")");
  p.record = true;
  return p;
}

// The rows layout (rows.cuh, jax_onnx_attn.ops.linear.pack_nbits_rows): 4-bit weights for 2..32
// rows of x. A warp owns a row group of kRowsGroup W rows (four m16 tiles) and streams its K range
// through a ring in shared memory, kRowsStageK elements (1 KB of W) a stage.
inline constexpr int kRowsGroup = 64;
inline constexpr int kRowsStageK = 32;
// A ring stage: W (1 KB, each lane's 2 x 16 bytes, read back by the lane that copied them), then the
// row group's block metadata once: the 16 bytes of scales of each g at kRowsStageScales + 16 g
// (copied by lane (g, 0)) and its 8 bytes of zero points at kRowsStageZeros + 8 g (lane (g, 1)),
// read by the four lanes of g after a warp barrier; padded to 128 bytes. Each lane used to copy its
// own 24 bytes of metadata (1792-byte stages): the shared copy makes the ring 29% smaller, so more
// CTAs fit an SM (session 24: the ~8B projections ran 1.7-2.2 warps a scheduler, issue-bound). The
// ring holds RowsRingPairs(depth) pairs of stages a warp (cp.async groups of a pair, at most 7 pending).
inline constexpr int kRowsStageScales = 1024;
inline constexpr int kRowsStageZeros = kRowsStageScales + 8 * 16;
inline constexpr int kRowsRingStageBytes = (kRowsStageZeros + 8 * 8 + 127) / 128 * 128;
inline constexpr int RowsRingPairs(int depth) { return 2 * depth; }
// Row groups (warps) a CTA may take (the planner takes 8 or 4: RowsPreferredWarps).
inline constexpr int kRowsWarps[4] = {8, 4, 2, 1};
// Occupancy: the CTAs of kThreads an SM the kernel's registers are capped for (Plan::ctas_per_sm,
// rows.cuh's __launch_bounds__(kThreads, 2): 128 registers a thread), with shared memory for as many.
// Occupancy 2 compiles without spills (ptxas -v, sm_90a, f16 and bf16, every fusion) for one n8 tile
// of x (M <= 8) and for two (M <= 16) except 4 stages of block-32 W (12-32 bytes); four tiles spill
// 76-490 bytes (f16). The launch instantiates only these.
inline constexpr bool RowsOccupancy2Fits(int nt, int depth, int64_t block_size) {
  return nt == 1 || (nt == 2 && (depth == 2 || block_size == 128));
}
// Planned depth: 2 (a ring of 4 pairs of stages a warp, up to 6 KB of W in flight), at either
// occupancy. On the H200 (session 21, tools/probes/rows_kernel_times.py, ~1B shapes at M 8 / 32)
// depth 4 was never faster and took 1.1-2.3x as long where its bigger rings left fewer CTAs an SM
// (the LM head); its rings do not fit twice an SM.
inline constexpr int kRowsPlannedDepth = 2;
// Warps a CTA the planner prefers: 4, and 8 for weights of at least kRowsWideCtas4 4-warp CTAs' row
// groups (the ~8B gate-up, the LM heads), which then split K into slices of at most kRowsWideSliceK
// with at least kRowsWideMinCtas CTAs. Why (H200, session 24, 1280-byte ring stages,
// bench/results/2026-12-03-c97125e-rows-sweep-{1b,8b}.json, µs at M 8 / 32): the ~8B gate-up (448
// row groups) 27.8 / 47.5 on 8 warps x 2 splits against 29.2 / 68.0 on 4 x 2 and 27.4 / 54.1 on
// 8 x 4; the ~8B LM head 91.6 / 183.9 on 8 x 2 against 100.5 / 234.8 on 8 x 4 (8 x 1: 98.8 at M 8);
// the ~1B LM head (K 2048) 47.7 / 95.6 on 8 x 1 against 51.1 / 108.6 on 8 x 2; the ~1B gate-up (256
// groups) 12.1 / 20.4 on 4 x 2 against 15.5 / 26.4 on 8 x 2. Where x's slice is big (M 32) a
// 2048-long slice leaves one CTA an SM, and 112 such CTAs beat 224 in two waves.
inline constexpr int64_t kRowsWideCtas4 = 96;
inline constexpr int64_t kRowsWideSliceK = 2048;
inline constexpr int kRowsWideMinCtas = 96;
inline int RowsPreferredWarps(int64_t groups) { return CeilDiv(groups, 4) >= kRowsWideCtas4 ? 8 : 4; }
// The planner's targets for 4-warp CTAs: at least kRowsMinCtas CTAs, and enough warps streaming
// that each has at most kRowsWarpBytes of W (capped at kRowsMaxWarps), with no K split below
// kRowsMinSliceK elements a CTA (8-warp CTAs: RowsPreferredWarps' targets). Among the layouts of the
// preferred warps a CTA that reach them it takes the fewest K splits (each adds a cluster's
// reduction and another CTA's start), then the most warps a CTA. On session 24's sweep (the
// 1280-byte ring stages, c97125e, above; 2-warp CTAs never won) it takes the fastest measured
// layout or one within 2% on all 20 cases: sum 695.2 µs against 694.1 for the fastest and 710.4
// for session 23's rule on the same kernel (816.7 before the smaller stages). The 4-warp targets were
// fitted to session 23's H200 sweep (tools/probes/rows_kernel_times.py
// d2, after the pushed reduction: clusters 1-16 x 4 / 8 warps, ~1B and ~8B projections at M 8 /
// 32, block 32): on those 20 cases it takes the fastest measured layout or one within 1% (sum of
// the 20 best 815.7 µs, planned 816.7; the earlier targets of 64 CTAs, 48 KB and 1024 warps:
// 851.3). Where they moved: ~8B qkv / o 4 x 8 (11.3 / 10.3 µs at M 8, 17.9 / 16.5 at M 32; they
// took 4 x 4: 12.4 / 11.7, 19.7 / 19.0), ~8B gate-up 4 x 2 at M 8 (30.3; 4 x 4: 32.9). The slice
// floor keeps the ~1B qkv / o (K 2048) at 8 splits: 16 ran 6-28% slower.
inline constexpr int kRowsMinCtas = 128;
inline constexpr int64_t kRowsWarpBytes = 32 * 1024;
inline constexpr int kRowsMaxWarps = 768;
inline constexpr int64_t kRowsMinSliceK = 256;

// The rows kernel's partial sums (rows.cuh, after the stream, over x's area and the rings): a CTA
// writes [cluster][8 nt][RowsPartPitch] f32, slot q holding the RowsPartRows W rows of its block
// that rank q finishes (16-row multiples: whole gate / up pairs; the 4 floats of padding spread the
// stores over the banks); with a cluster it then receives the same shape, slot q from rank q, on an
// mbarrier past the norm's statistics. One definition for the plan and the kernel (constexpr: both
// sides; rows.cuh builds with --expt-relaxed-constexpr).
constexpr int RowsPartRows(int rows_block, int cluster) { return rows_block / cluster; }
constexpr int RowsPartPitch(int rows_block, int cluster) { return RowsPartRows(rows_block, cluster) + 4; }
constexpr int RowsPartSlotFloats(int rows_block, int cluster, int nt) {
  return 8 * nt * RowsPartPitch(rows_block, cluster);
}
// Bytes a rank receives from the others: cluster - 1 slots of m rows.
constexpr uint32_t RowsRecvBytes(int m, int rows_block, int cluster) {
  return uint32_t(cluster - 1) * uint32_t(m) * uint32_t(RowsPartPitch(rows_block, cluster)) * 4u;
}
// The norm's statistics: each thread's sums of squares [nt][threads], then per x row its sum and
// inverse RMS (2 kMaxM f32).
constexpr int64_t RowsNormBytes(int threads, int nt) { return (int64_t(threads) * nt + 2 * kMaxM) * 4; }
// The received partials' mbarrier: past the norm's statistics (at gamma_offset).
constexpr int64_t RowsBarrierOffset(int64_t gamma_offset, bool norm, int threads, int nt) {
  return gamma_offset + (norm ? RowsNormBytes(threads, nt) : 0);
}

// Shared memory of the rows kernel: x's K slice in fragment order (16 bytes per x row of an n8
// tile per 8 k), then the warps' W rings (depth p.stages), both aliased after the stream by the
// partial sums and, with a cluster, those received (RowsPartSlotFloats: not aliased); then, with the
// norm, its statistics (written while the rings fill: not aliased); then the mbarrier the received
// partial sums complete on (16 bytes).
inline void RowsSmem(Plan& p) {
  const int64_t x = int64_t(p.k / p.cluster) * p.nt * 16;
  const int64_t part = int64_t(p.cluster > 1 ? 2 : 1) * p.cluster * RowsPartSlotFloats(p.rows_block, p.cluster, p.nt) * 4;
  const int64_t rings = int64_t(p.warps_n) * RowsRingPairs(p.stages) * 2 * kRowsRingStageBytes;
  p.x_bytes = Align16(x);
  p.red_bytes = Align16(part);
  p.ring_offset = p.x_bytes;
  p.gamma_offset = std::max(p.x_bytes + rings, p.red_bytes);
  p.smem_bytes = RowsBarrierOffset(p.gamma_offset, p.norm, 32 * p.warps_n, p.nt) + 16;
}

// The plan of y[m, n_out] = x[m, k] W^T for 4-bit weights in the rows layout (block_size 32 or
// 128). force_cluster / force_warps_n / force_depth / force_occupancy > 0 fix that choice (sweeps).
// Planned occupancy: 1 (a forced 2 caps a thread at 128 registers). The occupancy and depth change
// no bits (the same sums in the same order). Below sm_90: no clusters (one CTA takes all of K).
inline Plan MakeRowsPlan(int64_t m, int64_t n_rows, int64_t k, int64_t block_size, bool gated, bool norm,
                         bool sm90, int64_t force_cluster = 0, int64_t force_warps_n = 0,
                         int64_t force_depth = 0, int64_t force_occupancy = 0) {
  Plan best;
  auto fail = [&](const std::string& why) {
    best.error = "rows layout: " + why;
    return best;
  };
  if (m < 1 || m > kMaxM) return fail("x must have 1 to " + std::to_string(kMaxM) + " rows");
  if (block_size != 32 && block_size != 128) return fail("block_size must be 32 or 128");
  if (k < block_size || k % block_size != 0 || k > (int64_t(1) << 30)) {
    return fail("K must be a positive multiple of block_size");
  }
  if (n_rows < 8 || n_rows % (gated ? 16 : 8) != 0 || n_rows > (int64_t(1) << 30)) {
    return fail(gated ? "gated W rows must be a positive multiple of 16" : "N must be a positive multiple of 8");
  }
  if (force_cluster < 0 || force_cluster > kMaxCluster || (force_cluster & (force_cluster - 1))) {
    return fail("cluster must be 0 (planned) or a power of two up to 16");
  }
  if (force_warps_n < 0 || force_warps_n > kWarps || (force_warps_n & (force_warps_n - 1))) {
    return fail("warps_n must be 0 (planned), 1, 2, 4 or 8");
  }
  if (force_depth != 0 && force_depth != 2 && force_depth != 4) return fail("depth must be 0 (planned), 2 or 4");
  if (force_occupancy < 0 || force_occupancy > 2) return fail("occupancy must be 0 (planned), 1 or 2");
  if (force_cluster > 1 && !sm90) return fail("thread-block clusters need sm_90 or newer");
  const int nt = TilesM(m);
  if (force_occupancy == 2 &&
      !RowsOccupancy2Fits(nt, force_depth > 0 ? int(force_depth) : kRowsPlannedDepth, block_size)) {
    return fail("occupancy 2 (128 registers a thread) takes M <= 8, or M <= 16 with block_size 128 or depth 2");
  }
  const int64_t groups = CeilDiv(n_rows, kRowsGroup);
  const int64_t w_bytes = groups * kRowsGroup * k / 2;
  const int64_t want_warps = std::max<int64_t>(1, std::min<int64_t>(kRowsMaxWarps, w_bytes / kRowsWarpBytes));
  const int64_t budget = sm90 ? kSmemOnePerSm : kSmemOnePerSm80;
  const int64_t budget_two = sm90 ? kSmemTwoPerSm : kSmemTwoPerSm80;
  const int preferred_warps = RowsPreferredWarps(groups);
  bool found = false;
  bool best_full = false;
  for (int rw : kRowsWarps) {
    if (force_warps_n > 0 ? rw != force_warps_n : rw < 4) continue;  // planned: 8 or 4 warps a CTA
    for (int s = 1; s <= (sm90 ? kMaxCluster : 1); s *= 2) {
      if (force_cluster > 0 && s != force_cluster) continue;
      // Each rank finishes 64 rw / s rows of the CTA's block: whole gate / up pairs of 8.
      if (k % (s * block_size) != 0 || kRowsGroup * rw / s < 16) continue;
      if (force_cluster == 0 && s > 1 && k / s < kRowsMinSliceK) continue;  // planned splits only
      Plan p;
      p.rows = true;
      p.m = int(m);
      p.n_rows = int(n_rows);
      p.n_out = int(gated ? n_rows / 2 : n_rows);
      p.k = int(k);
      p.bits = 4;
      p.norm = norm;
      p.nt = nt;
      p.cluster = s;
      p.warps_n = rw;
      p.warps_k = 1;
      p.rows_block = kRowsGroup * rw;
      p.blocks = int(CeilDiv(groups, rw));
      p.groups = p.blocks;
      p.grid = p.blocks * s;
      p.waves = 1;
      // The depth sizes the rings (shared memory). A cluster of 16 needs CTAs that share SMs (16
      // one-CTA SMs in a GPC: not guaranteed), so it must fit twice an SM, as occupancy 2 must.
      p.ctas_per_sm = force_occupancy > 0 ? int(force_occupancy) : 1;
      p.stages = force_depth > 0 ? int(force_depth) : kRowsPlannedDepth;
      RowsSmem(p);
      if (p.smem_bytes > (p.ctas_per_sm == 2 || s > 8 ? budget_two : budget)) continue;
      const bool full = rw == 8 && preferred_warps == 8
                            ? k / s <= kRowsWideSliceK && p.grid >= kRowsWideMinCtas
                            : p.grid >= kRowsMinCtas && int64_t(p.grid) * rw >= want_warps;
      bool better;
      if (!found) {
        better = true;
      } else if ((rw == preferred_warps) != (best.warps_n == preferred_warps)) {
        better = rw == preferred_warps;
      } else if (full != best_full) {
        better = full;
      } else if (full) {
        better = s < best.cluster || (s == best.cluster && rw > best.warps_n);
      } else {  // none reaches the targets (a small weight): the most warps, then the fewest splits
        const int64_t a = int64_t(p.grid) * rw, b = int64_t(best.grid) * best.warps_n;
        better = a > b || (a == b && s < best.cluster);
      }
      if (better) {
        best = p;
        best_full = full;
        found = true;
      }
    }
  }
  if (!found) {
    return fail("no layout fits (K " + std::to_string(k) + " with block_size " + std::to_string(block_size) +
                (force_cluster > 0 ? ", cluster " + std::to_string(force_cluster) : std::string()) +
                ": x's K slice and the warps' W rings must fit in shared memory" +
                (force_occupancy == 2 ? std::string(" twice an SM (occupancy 2)") : std::string()) +
                " and the cluster must divide K into whole blocks)");
  }
  return best;
}

}  // namespace joa::gemv
