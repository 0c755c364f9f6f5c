// A chain of one-row dense projections in one persistent launch (row_chain.cuh): its parameters,
// the geometry's host-side rules, the chains the handlers run and the launch, for the handlers
// (ffi/handlers/gated_mlp.cu: gated_mlp's N split, and out_mlp: the attention's output projection +
// the gated MLP) and the probes (tools/probes/mlp_row.cu, layer_chain.cu).
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

// The chains the handlers run (ffi/handlers/gated_mlp.cu), in one place for them, the grid rule
// (pointers null: shapes only) and the probes. gated_mlp's N split: the gated gate / up [2 I, H]
// (RMS norm when gamma) into h, then down [H, I] with the residual into y.
inline RowChainParams GatedMlpChain(int h, int inter, const void* x, const void* gamma, const void* w_gate_up,
                                    const void* w_down, const void* residual, void* hidden, void* y) {
  RowChainParams p{};
  p.phases = 2;
  p.ph[0] = RowChainPhase{w_gate_up, x, gamma, nullptr, hidden, h, 2 * inter, 1};
  p.ph[1] = RowChainPhase{w_down, hidden, nullptr, residual, y, inter, h, 0};
  return p;
}

// out_mlp: o [H, Ho] with the residual x into x1, then the gated MLP of x1 with x1 as its residual.
inline RowChainParams OutMlpChain(int h, int ho, int inter, const void* a, const void* w_o, const void* x,
                                  const void* gamma, const void* w_gate_up, const void* w_down, void* x1,
                                  void* hidden, void* y) {
  const RowChainParams mlp = GatedMlpChain(h, inter, x1, gamma, w_gate_up, w_down, x1, hidden, y);
  RowChainParams p{};
  p.phases = 3;
  p.ph[0] = RowChainPhase{w_o, a, nullptr, x, x1, ho, h, 0};
  p.ph[1] = mlp.ph[0];
  p.ph[2] = mlp.ph[1];
  return p;
}

// Their phases, shapes only (the grid rule and the handlers' checks read them).
inline RowChainParams GatedMlpShapes(int h, int inter) {
  return GatedMlpChain(h, inter, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
}
inline RowChainParams OutMlpShapes(int h, int ho, int inter) {
  return OutMlpChain(h, ho, inter, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
}

// The workspaces, f32 elements: gated_mlp's N split h (I of T); out_mlp's x1 then h (H + I of T;
// H a multiple of 512 keeps h 16-byte aligned).
inline int64_t GatedMlpChainWorkspaceElems(int inter) { return (int64_t(inter) + 1) / 2; }
inline int64_t OutMlpWorkspaceElems(int h, int inter) { return (int64_t(h) + inter + 1) / 2; }

#if defined(__CUDACC__) || defined(__CUDA_RUNTIME_H__)  // the handler includes cuda_runtime.h first
// Launches the chain cooperatively (every CTA resident, or the launch fails) for dtype T (bf16 =
// false: f16) at kRowChainWarps x kRowChainDepth.
cudaError_t LaunchRowChain(const RowChainParams& p, bool bf16, int grid, cudaStream_t stream);
#endif

}  // namespace joa::gemv
