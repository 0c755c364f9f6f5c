// Host-side launch of the decode engine: the warp layout from the packed row count, the variant,
// the split kernel and (with several splits) the combine. Geometry depends only on the params'
// static shapes, never on device data, so a handler can be captured in a command buffer.
#pragma once

#include <cuda_runtime.h>

#include "kernels/decode/combine.cuh"
#include "kernels/decode/engine.cuh"
#include "kernels/decode/engine_qregs.cuh"
#include "kernels/decode/params.h"
#include "kernels/decode/plan.h"

namespace joa::decode {

// The split kernel of a KV policy: DecodeSplitKernel, or DecodeSplitKernelQRegs for a cache
// dequantised in registers, in its key-rows form (key_rows.cuh) where key_rows asks and the block
// fits (one warp row, at most kKeyRowsMaxRows rows).
template <typename T, int kD, int kWarpsM, int kWarpsN, class Variant, class Kv>
auto SplitKernel(int rows, bool key_rows) {
  if constexpr (Kv::kInRegs) {
    if constexpr (kWarpsM == 1) {
      if (key_rows && rows <= kKeyRowsMaxRows) return &DecodeSplitKernelQRegs<T, kD, kWarpsM, kWarpsN, Variant, Kv, true>;
    }
    return &DecodeSplitKernelQRegs<T, kD, kWarpsM, kWarpsN, Variant, Kv>;
  } else {
    return &DecodeSplitKernel<T, kD, kWarpsM, kWarpsN, Variant, Kv>;
  }
}

template <typename T, int kD, int kWarpsM, int kWarpsN, class Variant, class Kv>
cudaError_t LaunchLayout(DecodeParams p, bool pdl, cudaStream_t stream, bool key_rows = false) {
  using Cfg = EngineConfig<T, kD, kWarpsM, kWarpsN, Kv>;
  auto* split_kernel = SplitKernel<T, kD, kWarpsM, kWarpsN, Variant, Kv>(p.rows, key_rows);
  // A function attribute, not stream work: allowed while XLA captures the stream; set on every
  // launch because it is per device.
  cudaError_t err = cudaFuncSetAttribute(split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Cfg::kSmemBytes);
  // All of L1 as shared memory: the KV stream bypasses L1 (cp.async.cg), and the occupancy the
  // stage count was sized for (two CTAs of ~113 KB) needs the largest carveout.
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(split_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared));
  }
  if (err != cudaSuccess) return err;
  p.m_blocks = (p.rows + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const dim3 grid(unsigned(p.splits), unsigned(p.kv_heads * p.m_blocks), unsigned(p.batch));
  if (p.cluster > 1) {  // the splits of a block form one cluster and combine in it: one launch
    if (!Cfg::kClusterCombine) return cudaErrorNotSupported;
    if (p.cluster > 8) {  // beyond the portable cluster size
      err = cudaFuncSetAttribute(split_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (err != cudaSuccess) return err;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(Cfg::kLaunchThreads);
    cfg.dynamicSmemBytes = Cfg::kSmemBytes;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(p.cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, split_kernel, p);
  }
  split_kernel<<<grid, Cfg::kLaunchThreads, Cfg::kSmemBytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.splits == 1) return err;

  return LaunchCombine(DecodeCombineKernel<T, kD>, p, int64_t(p.batch) * p.kv_heads * p.rows, kCombineWarps, pdl,
                       stream);
}

template <typename T, int kD, class Variant, class Kv>
cudaError_t LaunchVariant(const DecodeParams& p, bool pdl, cudaStream_t stream, bool key_rows = false) {
  switch (BlockRows(p.rows)) {
    case 16: return LaunchLayout<T, kD, WarpsM(16), WarpsN(16), Variant, Kv>(p, pdl, stream, key_rows);
    case 32: return LaunchLayout<T, kD, WarpsM(32), WarpsN(32), Variant, Kv>(p, pdl, stream);
    case 64: return LaunchLayout<T, kD, WarpsM(64), WarpsN(64), Variant, Kv>(p, pdl, stream);
    default: return LaunchLayout<T, kD, WarpsM(128), WarpsN(128), Variant, Kv>(p, pdl, stream);
  }
}

template <typename T, int kD, KvFormat kKv>
cudaError_t Launch(const DecodeParams& p, const LaunchOptions& opt, cudaStream_t stream) {
  if constexpr (kKv != KvFormat::kDense) {
    using RegKv = QuantRegKv<T, KvBits(kKv)>;
    constexpr int64_t kRowBytes = RegKv::template RowBytes<kD>();
    // The register kernel copies whole tiles as blocks of rows (QuantRegKv::TileStream): rows one
    // after another, as ConfigureKvQuant lays them out; the tile kernel takes any strides.
    if (opt.quant_regs && p.k_stride_n == kRowBytes && p.v_stride_n == kRowBytes) {
      using Kv = RegKv;
      return opt.logit_variant ? LaunchVariant<T, kD, LogitVariant, Kv>(p, opt.pdl, stream, opt.key_rows)
                               : LaunchVariant<T, kD, MaskVariant, Kv>(p, opt.pdl, stream, opt.key_rows);
    }
  }
  if constexpr (kKv == KvFormat::kDense) {
    // The caller has checked the GPU (sm_90); rows one after another, as for the cursor loads; and
    // 16-row blocks only (kProducerBlockRows, plan.h).
    const bool contiguous = p.k_stride_n == kD && p.v_stride_n == kD;
    if (opt.producer && contiguous && BlockRows(p.rows) == kProducerBlockRows) {
      using Kv = DenseProducerKv<T>;
      constexpr int kWm = WarpsM(kProducerBlockRows), kWn = WarpsN(kProducerBlockRows);
      return opt.logit_variant ? LaunchLayout<T, kD, kWm, kWn, LogitVariant, Kv>(p, opt.pdl, stream)
                               : LaunchLayout<T, kD, kWm, kWn, MaskVariant, Kv>(p, opt.pdl, stream);
    }
    // The wide tile: 16-row blocks at the head dims it is compiled for, splits of whole wide tiles
    // (the rule of plan.h's MakePlan, which the plan's tile_rows reports). Its copies follow the
    // cursor-loads switch, except at d128, which takes the cursor copies only (the strided ones of
    // a 128-row tile need more than 255 registers there) and keeps its default tile for a cache
    // whose rows are not contiguous (never from decode_attention's handler).
    if constexpr (WideTile(16, kD, KvFormat::kDense, true)) {
      constexpr bool kStridedWide = kD < 128;
      if (opt.tile128 && WideTile(p.rows, kD, KvFormat::kDense, true) && p.split_rows % kWideTileN == 0 &&
          (kStridedWide || contiguous)) {
        constexpr int kWm = WarpsM(16), kWn = WarpsN(16);
        if (contiguous && (opt.cursor_loads || !kStridedWide)) {
          using Kv = WideTileKv<DenseCursorKv<T>, kWideTileN>;
          return opt.logit_variant ? LaunchLayout<T, kD, kWm, kWn, LogitVariant, Kv>(p, opt.pdl, stream)
                                   : LaunchLayout<T, kD, kWm, kWn, MaskVariant, Kv>(p, opt.pdl, stream);
        }
        if constexpr (kStridedWide) {
          using Kv = WideTileKv<DenseKv<T>, kWideTileN>;
          return opt.logit_variant ? LaunchLayout<T, kD, kWm, kWn, LogitVariant, Kv>(p, opt.pdl, stream)
                                   : LaunchLayout<T, kD, kWm, kWn, MaskVariant, Kv>(p, opt.pdl, stream);
        }
      }
    }
    if (opt.cursor_loads && p.k_stride_n == kD && p.v_stride_n == kD) {  // rows one after another
      using Kv = DenseCursorKv<T>;
      return opt.logit_variant ? LaunchVariant<T, kD, LogitVariant, Kv>(p, opt.pdl, stream)
                               : LaunchVariant<T, kD, MaskVariant, Kv>(p, opt.pdl, stream);
    }
  }
  using Kv = KvPolicy<T, kKv>;
  return opt.logit_variant ? LaunchVariant<T, kD, LogitVariant, Kv>(p, opt.pdl, stream)
                           : LaunchVariant<T, kD, MaskVariant, Kv>(p, opt.pdl, stream);
}

}  // namespace joa::decode

// Explicit instantiations live in one translation unit per (dtype, head dim, cache format), generated
// by cmake/decode_instances.cmake, so the build compiles them in parallel; handlers include decode.h.
#define JOA_DECODE_INSTANTIATE(T, D, F)                                     \
  template cudaError_t joa::decode::Launch<T, D, joa::KvFormat::F>(         \
      const joa::decode::DecodeParams&, const joa::decode::LaunchOptions&, cudaStream_t);
