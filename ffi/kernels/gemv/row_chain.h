// A chain of one-row dense projections in one persistent launch (row_chain.cuh): its parameters,
// the geometry's host-side rules and the launch, for the handlers (ffi/handlers/gated_mlp.cu: the
// attention's output projection + the gated MLP, out_mlp) and tools/probes/layer_chain.cu.
#pragma once

#include <cstdint>

#include "kernels/gemv/plan.h"  // kSmemOnePerSm

namespace joa::gemv {

inline constexpr int kRowChainMaxPhases = 4;

// One projection of the chain: out = epilogue(prologue(in) W^T), W [n_rows, k] row-major (T).
struct RowChainPhase {
  const void* w;
  const void* in;        // [k] T: the previous kernel's, or a phase before's output
  const void* gamma;     // [k] T: RMS norm weight of `in`, or null
  const void* residual;  // [n_out] T added after rounding, or null (may be a phase before's output)
  void* out;             // [n_out] T: n_rows, or n_rows / 2 when gated
  int k, n_rows;
  int gated;             // 16-row tiles of 8 gate rows then 8 up rows (interleave_gate_up) -> SiLU·up
};

struct RowChainParams {
  RowChainPhase ph[kRowChainMaxPhases];
  int phases;
  float eps;
};

// The variant the launch runs: the dense row kernel's warps and steps in flight, so each phase adds
// its sums in that kernel's order and the chain gives the separate launches' bits. Not yet timed
// against 16 warps (tools/probes/layer_chain.cu times both).
inline constexpr int kRowChainWarps = kWarps;
inline constexpr int kRowChainDepth = 3;

// Shared memory: the staged input (the longest K of T), a zero unit, [2][kW][16] f32 tile sums, kW
// f32 norm sums.
template <int kW>
constexpr int RowChainSmemBytes(int k_max) {
  return k_max * 2 + 16 + (2 * kW * 16 + kW) * 4;
}

// The longest K (constexpr: the kernel's shared-memory carve-up calls it too).
constexpr int RowChainMaxK(const RowChainParams& p) {
  int k = 0;
  for (int q = 0; q < p.phases; ++q) k = p.ph[q].k > k ? p.ph[q].k : k;
  return k;
}

// Whether the kernel takes the phases on `grid` CTAs: each K a multiple of the warps' 64-wide steps,
// whole 16-row tiles, every CTA resident (grid >= 1; the caller keeps grid <= SMs), shared memory
// within an sm_90 CTA's.
template <int kW>
inline bool RowChainFits(const RowChainParams& p, int grid) {
  if (p.phases < 1 || p.phases > kRowChainMaxPhases || grid < 1) return false;
  for (int q = 0; q < p.phases; ++q) {
    const RowChainPhase& ph = p.ph[q];
    if (ph.k < 64 * kW || ph.k % (64 * kW) != 0 || ph.n_rows < 16 || ph.n_rows % 16 != 0) return false;
  }
  return RowChainSmemBytes<kW>(RowChainMaxK(p)) <= kSmemOnePerSm;
}

// The grid for the phases on `sms` SMs. Each phase ends at a grid barrier, so it lasts as long as
// its busiest CTA: ceil(tiles_q / G) tiles of K_q. The G <= sms with the least sum of those over
// the phases (the W the busiest CTA streams), the fewest CTAs among equals (so a G dividing every
// tile count where one is as good: 128 on the ~1B / ~8B shapes at 132 SMs); 0 if none fits.
// (A divisor of every tile count alone can be far fewer CTAs: H 3584, I 18944 -> 32 of 132.)
inline int RowChainGrid(const RowChainParams& p, int sms) {
  int best = 0;
  int64_t best_cost = 0;
  for (int g = 1; g <= sms; ++g) {
    if (!RowChainFits<kRowChainWarps>(p, g)) continue;
    int64_t cost = 0;
    for (int q = 0; q < p.phases; ++q) cost += int64_t((p.ph[q].n_rows / 16 + g - 1) / g) * p.ph[q].k;
    if (best == 0 || cost < best_cost) {
      best = g;
      best_cost = cost;
    }
  }
  return best;
}

// The out_mlp chain's phases, shapes only (the grid rule's input; pointers null): o [H, Ho] with the
// residual, the gated gate / up [2 I, H], down [H, I] with o's output as its residual.
inline RowChainParams OutMlpShapes(int h, int ho, int inter) {
  RowChainParams p{};
  p.phases = 3;
  p.ph[0].k = ho;
  p.ph[0].n_rows = h;
  p.ph[1].k = h;
  p.ph[1].n_rows = 2 * inter;
  p.ph[1].gated = 1;
  p.ph[2].k = inter;
  p.ph[2].n_rows = h;
  return p;
}

// out_mlp's workspace, f32 elements: o's output (H of T) then h (I of T).
inline int64_t OutMlpWorkspaceElems(int h, int inter) { return (int64_t(h) + inter + 1) / 2; }

#if defined(__CUDACC__) || defined(__CUDA_RUNTIME_H__)  // the handler includes cuda_runtime.h first
// Launches the chain cooperatively (every CTA resident, or the launch fails) for dtype T (bf16 =
// false: f16) at kRowChainWarps x kRowChainDepth.
cudaError_t LaunchRowChain(const RowChainParams& p, bool bf16, int grid, cudaStream_t stream);
#endif

}  // namespace joa::gemv
