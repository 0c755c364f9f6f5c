// The fused gated MLP of one decode row on 4-bit weights (mlp_nbits.cuh): its parameters, the
// down projection's slice-record layout, the geometry's host-side rules and the launch.
#pragma once

#include <cstdint>

#include "kernels/gemv/mlp_row.h"  // MlpAddPartialsFits
#include "kernels/gemv/plan.h"     // kRecord*, kSmemOnePerSm

namespace joa::gemv {

// The slice records of the down projection (jax_onnx_attn.ops.linear.to_slice_record_layout):
// uint8 [H / kRecordRows, I / kSliceK, kSliceBytes], one record per (16-row tile, 64-k chunk): W,
// 16 bytes a lane (row g then row g + 8, K offsets 16 t .. + 15), then per (32-k half, g) 8 bytes:
// the scale bits of rows g and g + 8, their zero points, two zero bytes. A CTA's K slice of W_down
// is a whole number of records of every tile (the record layout's 256-k chunks are too long).
inline constexpr int kSliceK = 64;
inline constexpr int kSliceWBytes = kRecordRows * kSliceK / 2;  // 512
inline constexpr int kSliceBytes = kSliceWBytes + 2 * 8 * 8;     // 640

struct MlpNbitsParams {
  const void* x;          // [H] T: the MLP's input (before the norm)
  const void* gamma;      // [H] T, or null: no RMS norm prologue
  const uint8_t* w_gu;    // [2 I / 16, H / 256, kRecordBytes]: the record layout of the interleaved gate / up
  const uint8_t* w_down;  // [H / 16, I / 64, kSliceBytes]: the slice records of W_down [H, I]
  const void* residual;   // [H] T, or null
  void* y;                // [H] T
  float* partials;        // [G, H] f32 workspace
  float eps;
  int h, inter;           // H, I
  int tiles_per_cta;      // T: gate-up tiles a CTA (I / 8 / G), a multiple of 8
};

// Shared memory: x (H of T, staged in the slots kernel's fragment order), 512 zero bytes, x's Off_p /
// X_p per 32-k piece, [T][kW][16] f32 gate-up row sums (warp slots), h's slice (T units of 8,
// staged), h's Off_p / X_p per 16-k piece, kW f32 norm sums, kW * 32 f32 for the final reduction.
template <int kW>
struct MlpNbitsSmem {
  static constexpr int ZeroOffset(int h) { return h * 2; }
  static constexpr int XPieceOffset(int h) { return ZeroOffset(h) + 512; }
  static constexpr int RedOffset(int h) { return XPieceOffset(h) + h / 32 * 8; }
  static constexpr int HOffset(int h, int tiles) { return RedOffset(h) + tiles * kW * 16 * 4; }
  static constexpr int HPieceOffset(int h, int tiles) { return HOffset(h, tiles) + tiles * 16; }
  static constexpr int WsumOffset(int h, int tiles) { return HPieceOffset(h, tiles) + tiles / 2 * 8; }
  static constexpr int FinOffset(int h, int tiles) { return WsumOffset(h, tiles) + kW * 4; }
  static constexpr int Bytes(int h, int tiles) { return FinOffset(h, tiles) + kW * 32 * 4; }
};

// The geometry's requirements (host side): whole gate-up records (H % 256 == 0), whole down tiles and
// slice records (I % 64 == 0), (I / 8) % G == 0 with T = I / 8 / G a multiple of 8 (the CTA's h
// slice 8 T is whole slice records), a CTA's rows of y for the final reduction (MlpAddPartialsFits),
// the shared memory within an sm_90 CTA's. The quantisation
// block (a power of two >= 32 dividing H and I) is the layouts' concern: the kernel never sees it.
template <int kW>
inline bool MlpNbitsFits(int h, int inter, int grid) {
  if (h < kRecordK || h % kRecordK != 0 || inter < kSliceK || inter % kSliceK != 0 || grid <= 0) return false;
  if ((inter / 8) % grid != 0) return false;
  const int tiles = inter / 8 / grid;
  return tiles % 8 == 0 && MlpAddPartialsFits<kW>(h, grid) && MlpNbitsSmem<kW>::Bytes(h, tiles) <= kSmemOnePerSm;
}

// Warps a CTA (one CTA an SM, launched cooperatively) and steps of W in flight a warp (a step is a
// gate-up record, 2432 bytes, or four slice records, 2560). Unmeasured: the K split's dense
// figures (mlp_row.h: 16 x 2).
inline constexpr int kMlpNbitsWarps = 16;
inline constexpr int kMlpNbitsDepth = 2;

// The grid for H x I on `sms` SMs: the most CTAs <= sms the kernel takes, 0 if none (~1B 2048 x 8192:
// 128; ~8B 4096 x 14336: 112).
inline int MlpNbitsGrid(int h, int inter, int sms) {
  for (int g = sms; g > 0; --g) {
    if (MlpNbitsFits<kMlpNbitsWarps>(h, inter, g)) return g;
  }
  return 0;
}

// The workspace a launch needs, f32 elements: the partial sums [G, H].
inline int64_t MlpNbitsWorkspaceElems(int h, int grid) { return int64_t(grid) * h; }

#if defined(__CUDACC__) || defined(__CUDA_RUNTIME_H__)  // the handler includes cuda_runtime.h first
// Launches the kernel cooperatively (every CTA resident, or the launch fails) for dtype T (bf16 =
// false: f16); norm: the RMS norm prologue (p.gamma set).
cudaError_t LaunchMlpNbits(const MlpNbitsParams& p, bool bf16, bool norm, int grid, cudaStream_t stream);
#endif

}  // namespace joa::gemv
