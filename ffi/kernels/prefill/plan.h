// The prefill engine's split-KV plan: host-only C++ (no CUDA headers), the one definition. The
// nanobind module exports it (jax_onnx_attn._ffi.prefill_plan; ops/cuda.py sizes the workspace
// result from it instead of re-deriving), the handler checks a call's workspace against it.
//
// Why: the engine's grid is B x Hkv x ceil(G * S / kBlockM) CTAs. Few-query calls (decode /
// speculative-verify steps of 16-64 packed rows per KV head, chunked prefill at small batch) give
// fewer CTAs than SMs, e.g. B 8 x Hkv 8 x 1 m-block = 64 CTAs on 132 SMs: half the GPU idles while
// each CTA streams a 32k-key cache. Split-KV (FA3's num_splits, the decode engine's split + combine)
// cuts each CTA's key tiles into `splits` fixed ranges, one CTA each, and merges the partial results
// (combine.cuh) in a fixed order.
//
// A plan is a pure function of static shapes, so a call shape always gets the same splits, hence
// the same bits, on any GPU.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/prefill/params.h"

namespace joa::prefill {

// Most splits a call may have (combine.cuh keeps one weight a split per row in shared memory).
inline constexpr int kMaxSplits = 64;
// CTA slots the planner aims to fill: an H200's 132 SMs at one prefill CTA per SM (the engine's
// shared memory). A constant, not a device query (the decode planner's kPlanSms).
inline constexpr int kPlanSms = 132;
// Fewest key tiles a split streams: below, a split's fixed costs (the Q tile, the pipeline fill,
// its partial's write and the combine's read) stop being small against its tiles.
inline constexpr int kSplitMinTiles = 4;
// With at least this share of the slots already filled by (b, kvh, m-block) CTAs, no split (the
// decode planner's 0.8): the gain would be a tail effect, not a half-empty GPU.
inline constexpr int kSplitFullPercent = 80;
// The planner takes the fewest splits whose critical path is within this share of the shortest
// one: e.g. B 8 x Hkv 8 x 32k keys at d128, 2 splits (128 CTAs, 128 tiles each) rather than 37 (2368
// CTAs in 18 waves of 7 tiles: 126 tiles), whose 1.5% is less than the extra CTAs' and partials' cost.
inline constexpr int kSplitSlackPercent = 10;

// f32 elements of the workspace: normalised partial outputs [B, Hkv, splits, M, D] then their
// log2-sum-exps [B, Hkv, splits, M] (the decode engine's layout); nothing with one split.
constexpr int64_t WorkspaceElems(int64_t batch, int64_t kv_heads, int64_t splits, int64_t rows, int64_t d) {
  return splits > 1 ? batch * kv_heads * splits * rows * (d + 1) : 0;
}

// Head size d's default tiling (what calls that name no schedule run: its tune's keys per step and
// rows per CTA; the split kernels are compiled for it only).
constexpr Tiling DefaultTiling(int d) { return TunedTiling(d, kScheduleSpecs[TilingFor(d).schedule].tune); }

// Key tiles (of head size d's default tiling) one CTA's rows may see, from static shapes: all of
// T's, or, when a window bounds both sides (left >= 0, and right >= 0 or causal), the keys of its
// rows' windows: a CTA's rows span at most S positions, so left + S + right keys, + 1 tile for
// alignment.
constexpr int64_t VisibleTiles(int64_t q_rows, int64_t kv_rows, int d, bool causal, int64_t left, int64_t right) {
  const int64_t block_n = DefaultTiling(d).block_n;
  int64_t tiles = (kv_rows + block_n - 1) / block_n;
  const int64_t right_keys = causal ? 0 : right;
  if (left >= 0 && right_keys >= 0) {
    const int64_t keys = left + right_keys + q_rows;
    tiles = std::min(tiles, (keys + block_n - 1) / block_n + 1);
  }
  return tiles;
}

struct SplitPlan {
  int64_t splits;
  int64_t ctas;             // (b, kvh, m-block) CTAs before the split
  int64_t tiles;            // VisibleTiles: the key tiles the planner splits
  int64_t workspace_elems;  // f32 elements of the workspace result (>= 1: XLA wants a buffer)
};

// splits: 0 lets the planner choose, else 1..kMaxSplits (the caller checks). The rule, when fewer
// than kSplitFullPercent % of kPlanSms slots hold a CTA: of n in 1..min(kMaxSplits, tiles /
// kSplitMinTiles), cost(n) = waves(ctas * n) * ceil(tiles / n), the key tiles on the critical path;
// the fewest splits whose cost is within kSplitSlackPercent of the least (so n = 1 unless a split
// shortens the path by more than that).
inline SplitPlan MakeSplitPlan(int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t q_rows, int64_t kv_rows,
                               int d, bool causal, int64_t left, int64_t right, int64_t splits) {
  SplitPlan p{};
  const int64_t rows = (q_heads / std::max<int64_t>(kv_heads, 1)) * q_rows;
  // In 128-row blocks whatever the default's CTA rows (192 at D 64): a heuristic, and the Python
  // mirror of the rule (tests/test_prefill_split_plan.py) counts the same.
  p.ctas = batch * kv_heads * ((rows + kBlockM - 1) / kBlockM);
  p.tiles = std::max<int64_t>(1, VisibleTiles(q_rows, kv_rows, d, causal, left, right));
  if (splits <= 0) {
    splits = 1;
    if (p.ctas > 0 && p.ctas * 100 < int64_t(kSplitFullPercent) * kPlanSms) {
      const int64_t most = std::min<int64_t>(kMaxSplits, p.tiles / kSplitMinTiles);
      auto cost = [&](int64_t n) { return (p.ctas * n + kPlanSms - 1) / kPlanSms * ((p.tiles + n - 1) / n); };
      int64_t least = cost(1);
      for (int64_t n = 2; n <= most; ++n) least = std::min(least, cost(n));
      while (cost(splits) * 100 > least * (100 + kSplitSlackPercent)) ++splits;
    }
  }
  p.splits = splits;
  p.workspace_elems = std::max<int64_t>(1, WorkspaceElems(batch, kv_heads, splits, rows, d));
  return p;
}

}  // namespace joa::prefill
