// The fused gated MLP of one decode row: the K split (mlp_row.cuh) with its parameters, the
// geometry's host-side rules and the launch, and the rules of both splits for the handler
// (ffi/handlers/gated_mlp.cu) and the probe; the N split is the two-phase row chain (row_chain.h).
#pragma once

#include <cstdint>

#include "kernels/gemv/plan.h"       // kSmemOnePerSm
#include "kernels/gemv/row_chain.h"  // the N split

namespace joa::gemv {

struct MlpRowParams {
  const void* x;         // [H] T: the MLP's input (before the norm)
  const void* gamma;     // [H] T, or null: no RMS norm prologue
  const void* w_gu;      // [2 I, H] T, gate / up interleaved in blocks of 8 rows (interleave_gate_up)
  const void* w_down;    // [H, I] T
  const void* residual;  // [H] T, or null
  void* y;               // [H] T
  float* partials;       // [G, H] f32 workspace
  float eps;
  int h, inter;          // H, I
  int tiles_per_cta;     // T: gate-up tiles a CTA (I / 8 / G)
};

// Shared memory: x (H of T, after the prologue), h slice (8 T of T), a zero unit, [2][kW][16] f32
// partial row sums of the gate-up tiles, kW f32 norm sums, kW * 32 f32 for the final reduction.
template <int kW>
struct MlpRowSmem {
  static constexpr int HOffset(int h) { return h * 2; }
  static constexpr int ZeroOffset(int h, int tiles) { return h * 2 + tiles * 16; }
  static constexpr int RedOffset(int h, int tiles) { return ZeroOffset(h, tiles) + 16; }
  static constexpr int Bytes(int h, int tiles) {
    return RedOffset(h, tiles) + (2 * kW * 16 + kW + kW * 32) * 4;
  }
};

// The K split's final reduction (mlp_row.cuh's MlpAddPartials) takes a CTA's ceil(H / G) rows of y
// with at most one thread a row (its s_fin holds kW * 32 floats).
template <int kW>
inline bool MlpAddPartialsFits(int h, int grid) {
  return grid > 0 && (h + grid - 1) / grid <= 32 * kW;
}

// The geometry's requirements (host side): H % (64 kW) == 0, (H / 16) % kW == 0, I % 8 == 0,
// (I / 8) % G == 0, the h slice 8 T a multiple of 64, a CTA's rows of y for the final reduction
// (MlpAddPartialsFits), and the shared memory within an sm_90 CTA's.
template <int kW>
inline bool MlpRowFits(int h, int inter, int grid) {
  if (h % (64 * kW) != 0 || (h / 16) % kW != 0 || inter % 8 != 0 || grid <= 0) return false;
  if ((inter / 8) % grid != 0) return false;
  const int tiles = inter / 8 / grid;
  return (8 * tiles) % 64 == 0 && MlpAddPartialsFits<kW>(h, grid) && MlpRowSmem<kW>::Bytes(h, tiles) <= kSmemOnePerSm;
}

// The variant the launch runs: warps a CTA and steps of W in flight a warp. tools/probes/mlp_row.cu
// on an H100, µs a layer at 16 warps x 2 / 3 / 4 steps: ~1B 40.2 / 41.8 / 41.5, ~8B 125.4 / 129.9 /
// 126.0 (8 warps x 3 / 4 / 6: 41.7 / 40.9 / 42.1 and 133.2 / 126.9 / 127.5). Session 37's whole-step
// figures were taken at 16 x 3.
inline constexpr int kMlpRowWarps = 16;
inline constexpr int kMlpRowDepth = 2;

// Whether the split's kernel takes H x I on `grid` CTAs (the handler's and the launch's check).
inline bool MlpRowTakes(int h, int inter, int grid, bool n_split) {
  return n_split ? RowChainFits<kRowChainWarps>(GatedMlpShapes(h, inter), grid)
                 : MlpRowFits<kMlpRowWarps>(h, inter, grid);
}

// The grid for H x I on `sms` SMs, 0 if none: the K split's most CTAs <= sms it takes; the N
// split's the row chain's rule (RowChainGrid).
inline int MlpRowGrid(int h, int inter, int sms, bool n_split = false) {
  if (n_split) return RowChainGrid(GatedMlpShapes(h, inter), sms);
  for (int g = sms; g > 0; --g) {
    if (MlpRowFits<kMlpRowWarps>(h, inter, g)) return g;
  }
  return 0;
}

// The workspace a launch needs, f32 elements: the K split's partials [G, H], the N split's h (I of T).
inline int64_t MlpRowWorkspaceElems(int h, int inter, int grid, bool n_split) {
  return n_split ? GatedMlpChainWorkspaceElems(inter) : int64_t(grid) * h;
}

#if defined(__CUDACC__) || defined(__CUDA_RUNTIME_H__)  // the handler includes cuda_runtime.h first
// Launches the K split's kernel cooperatively (every CTA resident, or the launch fails) for dtype T
// (bf16 = false: f16); norm: the RMS norm prologue (p.gamma set).
cudaError_t LaunchMlpRow(const MlpRowParams& p, bool bf16, bool norm, int grid, cudaStream_t stream);
#endif

}  // namespace joa::gemv
