// Host-side launch of the GEMV engine: the kernel for (n8 tiles, fusion), its shared memory and
// cluster attributes, and the launch itself. Geometry comes from the plan only (plan.h), so a
// handler can be captured in a command buffer.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "common/launch.h"
#include "kernels/gemv/dense_row.cuh"
#include "kernels/gemv/epilogue.cuh"
#include "kernels/gemv/gemv.h"
#include "kernels/gemv/kernel.cuh"
#include "kernels/gemv/rows.cuh"
#include "kernels/gemv/slots.cuh"
#include "kernels/gemv/stage.cuh"
#include "kernels/gemv/weights.cuh"

namespace joa::gemv {

// Launches `kernel` on the plan's grid with `smem` bytes of dynamic shared memory (set as a
// function attribute: not stream work, so allowed while XLA captures the stream; set on every
// launch because it is per device), the plan's cluster and, with pdl, as a programmatic dependent.
// max_shared: the carveout that lets ctas_per_sm CTAs share an SM (W bypasses L1). threads: a CTA's.
// Under a LaunchRecorder (the record stage) the launch is recorded instead (common/launch.h).
template <class Kernel>
cudaError_t LaunchPlanned(Kernel* kernel, const GemvParams& p, const Plan& plan, int smem, bool max_shared,
                          bool pdl, cudaStream_t stream, int threads = kThreads) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(plan.grid));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  if (LaunchRecorder* recorder = LaunchRecorder::Active()) {
    // Over 48 KB of dynamic shared memory needs the function's opt-in attribute too.
    return recorder->Add(reinterpret_cast<const void*>(kernel), cfg, unsigned(plan.cluster > 1 ? plan.cluster : 1),
                         pdl, /*needs_function_attributes=*/max_shared || plan.cluster > 8 || smem > 48 * 1024, p);
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess && max_shared) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared));
  }
  if (err == cudaSuccess && plan.cluster > 8) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  }
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (plan.cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = unsigned(plan.cluster);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = unsigned(n);
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// A fusion's policy types (stage.cuh's prologues, epilogue.cuh's epilogues) as a tag that a
// generic lambda takes apart.
template <class P, class E>
struct Policies {
  using Prologue = P;
  using Epilogue = E;
};

// launch(Policies<Prologue, Epilogue>{}) for the fusion: one place maps Fusion to the policies.
template <class Launch>
cudaError_t WithPolicies(Fusion fusion, Launch&& launch) {
  if (fusion.norm) {
    return fusion.gated ? launch(Policies<RmsNormInput, GatedSiluEpilogue>{})
                        : launch(Policies<RmsNormInput, StoreEpilogue>{});
  }
  return fusion.gated ? launch(Policies<PlainInput, GatedSiluEpilogue>{}) : launch(Policies<PlainInput, StoreEpilogue>{});
}

template <typename T, class Weights, int kNT, class Prologue, class Epilogue>
cudaError_t LaunchKernel(const GemvParams& p, const Plan& plan, bool pdl, cudaStream_t stream) {
  return LaunchPlanned(GemvKernel<T, Weights, kNT, Prologue, Epilogue>, p, plan, int(plan.smem_bytes),
                       /*max_shared=*/true, pdl, stream);
}

template <typename T, class Weights, class Prologue, class Epilogue>
cudaError_t LaunchTiles(const GemvParams& p, const Plan& plan, bool pdl, cudaStream_t stream) {
  switch (plan.nt) {
    case 1: return LaunchKernel<T, Weights, 1, Prologue, Epilogue>(p, plan, pdl, stream);
    case 2: return LaunchKernel<T, Weights, 2, Prologue, Epilogue>(p, plan, pdl, stream);
    default: return LaunchKernel<T, Weights, 4, Prologue, Epilogue>(p, plan, pdl, stream);
  }
}

// The plan's geometry into the kernel parameters.
inline void ApplyPlan(GemvParams& p, const Plan& plan, bool pdl) {
  p.kc = plan.kc;
  p.cpp = plan.cpp;
  p.stages = plan.stages;
  p.slice_chunks = plan.slice_chunks;
  p.cluster = plan.cluster;
  p.warps_n = plan.warps_n;
  p.warps_k = plan.warps_k;
  p.rows_block = plan.rows_block;
  p.blocks = plan.blocks;
  p.groups = plan.groups;
  p.red_stride = plan.red_stride;
  p.x_bytes = int(plan.x_bytes);
  p.red_bytes = int(plan.red_bytes);
  p.gamma_offset = int(plan.gamma_offset);
  p.ring_offset = int(plan.ring_offset);
  p.x_first = pdl ? 0 : 1;
}

// The slots kernel (one row, 4-bit wide weights; plan.slots): its fusion policies, shared memory,
// the cluster that shares x, PDL. Src: SlotFormat<T> (the wide format) or RecordFormat<T> (the
// record layout, plan.record).
template <typename T, class Src, class Prologue, class Epilogue>
cudaError_t LaunchSlotsKernel(const GemvParams& p, const Plan& plan, bool pdl, cudaStream_t stream) {
  const int smem = SlotsSmemBytes(p, Prologue::kNorm);
  if (smem != plan.smem_bytes) return cudaErrorInvalidValue;  // plan.h and slots.cuh disagree
  // The default carveout: scales and zero points are read through L1 (a max-shared carveout made
  // the LM head 54 -> 66 us).
  return LaunchPlanned(GemvSlotsKernel<T, Src, Prologue, Epilogue, kSlotsDepth>, p, plan, smem,
                       /*max_shared=*/false, pdl, stream);
}

// The slots kernel on 4-bit weights in the record layout (plan.record: MakeRecordPlan); p.w the
// records, p.scales / p.zeros unused (the records hold them).
template <typename T>
cudaError_t LaunchRecord(GemvParams p, const Plan& plan, Fusion fusion, bool pdl, cudaStream_t stream) {
  if (!plan.record || !plan.slots) return cudaErrorInvalidValue;
  ApplyPlan(p, plan, pdl);
  return WithPolicies(fusion, [&](auto pol) {
    using Pro = typename decltype(pol)::Prologue;
    using Epi = typename decltype(pol)::Epilogue;
    return LaunchSlotsKernel<T, RecordFormat<T>, Pro, Epi>(p, plan, pdl, stream);
  });
}


// The dense row kernel (one row, dense weights; plan.dense_row).
template <typename T, class Prologue, class Epilogue>
cudaError_t LaunchDenseRowKernel(const GemvParams& p, const Plan& plan, bool pdl, cudaStream_t stream) {
  const int smem = DenseRowSmemBytes(p.k);
  if (smem != plan.smem_bytes) return cudaErrorInvalidValue;  // plan.h and dense_row.cuh disagree
  // The default carveout, as the slots kernel: W goes through L1 (not kept) into registers, and
  // with all of L1 as shared memory fewer of its bytes were in flight (H200, same shapes, two
  // calls: the probe's copy of this kernel at the default carveout, ~8B LM head 231 us, gate-up
  // 55.0, down 29.9; the engine's at max-shared 251 / 60.2 / 34.5; bench/results/2026-12-02-gemv-dense-row.json).
  return LaunchPlanned(GemvDenseRowKernel<T, Prologue, Epilogue, kDenseRowDepth>, p, plan, smem,
                       /*max_shared=*/false, pdl, stream);
}

// The packed QKV projection with gqa_prepare in its epilogue (QkvRotaryEpilogue, p.qkv set): one row
// of x on the one-row kernels, dense weights (plan.dense_row) or 4-bit weights in the record layout
// (plan.record). norm: the RMS-norm prologue.
template <typename T>
cudaError_t LaunchQkvRotary(GemvParams p, const Plan& plan, bool norm, bool pdl, cudaStream_t stream) {
  ApplyPlan(p, plan, pdl);
  auto launch = [&](auto prologue) -> cudaError_t {
    using Pro = decltype(prologue);
    if (plan.dense_row && plan.bits == 16) {
      return LaunchDenseRowKernel<T, Pro, QkvRotaryEpilogue>(p, plan, pdl, stream);
    }
    if (plan.record && plan.slots) {
      return LaunchSlotsKernel<T, RecordFormat<T>, Pro, QkvRotaryEpilogue>(p, plan, pdl, stream);
    }
    return cudaErrorInvalidValue;  // the caller plans one of the two
  };
  return norm ? launch(RmsNormInput{}) : launch(PlainInput{});
}

// The rows kernel (4-bit weights in the rows layout; plan.rows): the instantiation for the plan's
// n8 tiles, W stages in flight, stages a quantisation block (block_size 32 or 128) and occupancy
// (only where plan.h's RowsOccupancy2Fits: the plan takes no other).
template <typename T, class Prologue, class Epilogue, int kNT, int kDS, int kSPB>
cudaError_t LaunchRowsOccupancy(const GemvParams& p, const Plan& plan, bool pdl, cudaStream_t stream) {
  const int threads = 32 * plan.warps_n;
  // The max-shared carveout: W goes through the warps' rings in shared memory (cp.async.cg, not
  // through L1), x is read from shared memory too.
  if (plan.ctas_per_sm == 1) {
    return LaunchPlanned(GemvRowsKernel<T, kNT, kDS, kSPB, 1, Prologue, Epilogue>, p, plan,
                         int(plan.smem_bytes), /*max_shared=*/true, pdl, stream, threads);
  }
  if constexpr (RowsOccupancy2Fits(kNT, kDS, kSPB * kRowsStageK)) {
    if (plan.ctas_per_sm == 2) {
      return LaunchPlanned(GemvRowsKernel<T, kNT, kDS, kSPB, 2, Prologue, Epilogue>, p, plan,
                           int(plan.smem_bytes), /*max_shared=*/true, pdl, stream, threads);
    }
  }
  return cudaErrorInvalidValue;
}

template <typename T, class Prologue, class Epilogue, int kNT, int kDS>
cudaError_t LaunchRowsSpb(const GemvParams& p, const Plan& plan, bool pdl, cudaStream_t stream) {
  switch (p.block_shift) {  // plan.h takes blocks of 32 and 128 only
    case 5: return LaunchRowsOccupancy<T, Prologue, Epilogue, kNT, kDS, 1>(p, plan, pdl, stream);
    case 7: return LaunchRowsOccupancy<T, Prologue, Epilogue, kNT, kDS, 4>(p, plan, pdl, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, class Prologue, class Epilogue, int kNT>
cudaError_t LaunchRowsDepth(const GemvParams& p, const Plan& plan, bool pdl, cudaStream_t stream) {
  switch (plan.stages) {
    case 2: return LaunchRowsSpb<T, Prologue, Epilogue, kNT, 2>(p, plan, pdl, stream);
    case 4: return LaunchRowsSpb<T, Prologue, Epilogue, kNT, 4>(p, plan, pdl, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t LaunchRows(GemvParams p, const Plan& plan, Fusion fusion, bool pdl, cudaStream_t stream) {
  if (!plan.rows) return cudaErrorInvalidValue;
  ApplyPlan(p, plan, pdl);
  return WithPolicies(fusion, [&](auto pol) {
    using Pro = typename decltype(pol)::Prologue;
    using Epi = typename decltype(pol)::Epilogue;
    switch (plan.nt) {
      case 1: return LaunchRowsDepth<T, Pro, Epi, 1>(p, plan, pdl, stream);
      case 2: return LaunchRowsDepth<T, Pro, Epi, 2>(p, plan, pdl, stream);
      default: return LaunchRowsDepth<T, Pro, Epi, 4>(p, plan, pdl, stream);
    }
  });
}

template <typename T, int kBits, bool kWide>
cudaError_t LaunchFormat(GemvParams p, const Plan& plan, Fusion fusion, bool pdl, cudaStream_t stream) {
  static_assert(kBits != 16 || !kWide, "dense weights have one format");
  using Weights =
      std::conditional_t<kBits == 16, DenseWeights<T>, NbitsWeights<T, kBits == 16 ? 8 : kBits, kWide>>;
  if (plan.wide != kWide) return cudaErrorInvalidValue;  // host.h picks the instantiation by plan.wide
  ApplyPlan(p, plan, pdl);
  return WithPolicies(fusion, [&](auto pol) {
    using Pro = typename decltype(pol)::Prologue;
    using Epi = typename decltype(pol)::Epilogue;
    if (plan.slots) {  // host.h plans the slots kernel for 4-bit wide weights only
      if constexpr (kBits == 4 && kWide) {
        if (plan.record) return cudaErrorInvalidValue;  // LaunchRecord's
        return LaunchSlotsKernel<T, SlotFormat<T>, Pro, Epi>(p, plan, pdl, stream);
      }
      return cudaErrorInvalidValue;
    }
    if (plan.dense_row) {  // and the dense row kernel for dense weights only
      if constexpr (kBits == 16) return LaunchDenseRowKernel<T, Pro, Epi>(p, plan, pdl, stream);
      return cudaErrorInvalidValue;
    }
    return LaunchTiles<T, Weights, Pro, Epi>(p, plan, pdl, stream);
  });
}

}  // namespace joa::gemv

// Explicit instantiations live in one translation unit per (dtype, format) (inst/*.cu), so the
// build compiles them in parallel; handlers include gemv.h only.
#define JOA_GEMV_INSTANTIATE_ROWS(T) \
  template cudaError_t joa::gemv::LaunchRows<T>(joa::gemv::GemvParams, const joa::gemv::Plan&, joa::gemv::Fusion, \
                                                bool, cudaStream_t);
#define JOA_GEMV_INSTANTIATE_RECORD(T) \
  template cudaError_t joa::gemv::LaunchRecord<T>(joa::gemv::GemvParams, const joa::gemv::Plan&, \
                                                  joa::gemv::Fusion, bool, cudaStream_t);
#define JOA_GEMV_INSTANTIATE_QKV_ROTARY(T) \
  template cudaError_t joa::gemv::LaunchQkvRotary<T>(joa::gemv::GemvParams, const joa::gemv::Plan&, bool, \
                                                     bool, cudaStream_t);
#define JOA_GEMV_INSTANTIATE(T, B, W)                                                            \
  template cudaError_t joa::gemv::LaunchFormat<T, B, W>(joa::gemv::GemvParams, const joa::gemv::Plan&, \
                                                        joa::gemv::Fusion, bool, cudaStream_t);
