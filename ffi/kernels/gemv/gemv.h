// The GEMV engine as handlers see it: one launch for any dtype, weight format and fusion.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/gemv/params.h"
#include "kernels/gemv/plan.h"

namespace joa::gemv {

// The fusions of one call (policy types inside; flags only at this boundary).
struct Fusion {
  bool gated;  // GatedSiluEpilogue, else StoreEpilogue (bias / residual are optional pointers)
  bool norm;   // RmsNormInput prologue, else PlainInput
};

// Launches the engine for T (__half / __nv_bfloat16), kBits (16 dense, 8, 4) and kWide (n-bit
// weights in the two-piece format: plan.h's FormatInfo; must equal plan.wide) with `plan` (copied
// into p's plan fields here). pdl: launch as a programmatic dependent of the previous kernel.
template <typename T, int kBits, bool kWide>
cudaError_t LaunchFormat(GemvParams p, const Plan& plan, Fusion fusion, bool pdl, cudaStream_t stream);

#define JOA_GEMV_DECLARE(T, B, W) \
  extern template cudaError_t LaunchFormat<T, B, W>(GemvParams, const Plan&, Fusion, bool, cudaStream_t);
JOA_GEMV_DECLARE(__half, 16, false)
JOA_GEMV_DECLARE(__half, 8, false)
JOA_GEMV_DECLARE(__half, 8, true)
JOA_GEMV_DECLARE(__half, 4, false)
JOA_GEMV_DECLARE(__half, 4, true)
JOA_GEMV_DECLARE(__nv_bfloat16, 16, false)
JOA_GEMV_DECLARE(__nv_bfloat16, 8, false)
JOA_GEMV_DECLARE(__nv_bfloat16, 8, true)
JOA_GEMV_DECLARE(__nv_bfloat16, 4, false)
JOA_GEMV_DECLARE(__nv_bfloat16, 4, true)
#undef JOA_GEMV_DECLARE

// Launches the rows kernel (rows.cuh) for 4-bit weights in the rows layout with `plan`
// (MakeRowsPlan).
template <typename T>
cudaError_t LaunchRows(GemvParams p, const Plan& plan, Fusion fusion, bool pdl, cudaStream_t stream);
extern template cudaError_t LaunchRows<__half>(GemvParams, const Plan&, Fusion, bool, cudaStream_t);
extern template cudaError_t LaunchRows<__nv_bfloat16>(GemvParams, const Plan&, Fusion, bool, cudaStream_t);

// Launches the slots kernel (slots.cuh's RecordFormat) for one row of x against 4-bit weights in
// the record layout with `plan` (MakeRecordPlan).
template <typename T>
cudaError_t LaunchRecord(GemvParams p, const Plan& plan, Fusion fusion, bool pdl, cudaStream_t stream);
extern template cudaError_t LaunchRecord<__half>(GemvParams, const Plan&, Fusion, bool, cudaStream_t);
extern template cudaError_t LaunchRecord<__nv_bfloat16>(GemvParams, const Plan&, Fusion, bool, cudaStream_t);

// Launches the packed QKV projection with GroupQueryAttention's step preparation in its epilogue
// (epilogue.cuh's QkvRotaryEpilogue; p.qkv set) with `plan`: MakePlan's dense row plan (dense
// weights, one row) or MakeRecordPlan's (4-bit weights in the record layout). norm: RMS-norm prologue.
template <typename T>
cudaError_t LaunchQkvRotary(GemvParams p, const Plan& plan, bool norm, bool pdl, cudaStream_t stream);
extern template cudaError_t LaunchQkvRotary<__half>(GemvParams, const Plan&, bool, bool, cudaStream_t);
extern template cudaError_t LaunchQkvRotary<__nv_bfloat16>(GemvParams, const Plan&, bool, bool, cudaStream_t);

}  // namespace joa::gemv
