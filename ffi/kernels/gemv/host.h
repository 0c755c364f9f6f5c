// Host side shared by the GEMV handlers (ffi/handlers/linear.cu, matmul_nbits.cu): the plan for the device at hand and the
// launch. Everything here depends on static shapes and attributes only (command-buffer safe).
#pragma once

#include <string>

#include "common/device.h"
#include "common/ffi.h"
#include "kernels/gemv/gemv.h"
#include "kernels/gemv/params.h"
#include "kernels/gemv/plan.h"

namespace joa::gemv {

// Whether the current device is sm_90+ (thread-block clusters, Hopper's shared memory). A device
// property, the same on every call: the plan stays a function of static shapes on a given GPU.
inline bool Sm90() { return CurrentComputeCapability().major >= 9; }

// The launch of one dtype: the instantiation for (bits, plan.wide).
template <typename T>
cudaError_t LaunchDtype(const GemvParams& p, const Plan& plan, int bits, Fusion fusion, bool pdl,
                        cudaStream_t stream) {
  if (bits == 16) return LaunchFormat<T, 16, false>(p, plan, fusion, pdl, stream);
  if (bits == 8) {
    return plan.wide ? LaunchFormat<T, 8, true>(p, plan, fusion, pdl, stream)
                     : LaunchFormat<T, 8, false>(p, plan, fusion, pdl, stream);
  }
  return plan.wide ? LaunchFormat<T, 4, true>(p, plan, fusion, pdl, stream)
                   : LaunchFormat<T, 4, false>(p, plan, fusion, pdl, stream);
}

// Checks `plan` against p and launches it with the instantiation launch(T{}) picks for x's dtype.
template <class LaunchFor>
ffi::Error LaunchChecked(const GemvParams& p, const Plan& plan, ffi::DataType dtype, const char* op,
                         LaunchFor launch) {
  if (!plan.error.empty()) return InvalidArgument(std::string(op) + ": " + plan.error);
  if (plan.n_out != p.n_out) return InvalidArgument(std::string(op) + ": output width mismatch");
  cudaError_t err;
  switch (dtype) {
    case ffi::DataType::F16: err = launch(__half{}); break;
    case ffi::DataType::BF16: err = launch(__nv_bfloat16{}); break;
    default:
      return InvalidArgument(std::string(op) + ": the GEMV kernels take f16 and bf16 only");
  }
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Plans y = x W^T for p's shape (p.m, p.n_rows, p.n_out, p.k set) and launches it. wide: n-bit
// weights in the two-piece format (plan.h's FormatInfo; ignored for dense weights).
// block_size / slots: MakePlan's (n-bit weights).
inline ffi::Error PlanAndLaunch(GemvParams& p, ffi::DataType dtype, int bits, Fusion fusion,
                                int64_t cluster, int64_t warps_k, bool wide, bool pdl,
                                cudaStream_t stream, const char* op, int64_t block_size = 0,
                                bool slots = false) {
  const Plan plan = MakePlan(p.m, p.n_rows, p.k, bits, fusion.gated, fusion.norm, Sm90(), cluster, warps_k,
                             wide, block_size, slots);
  return LaunchChecked(p, plan, dtype, op, [&](auto t) {
    return LaunchDtype<decltype(t)>(p, plan, bits, fusion, pdl, stream);
  });
}

// Plans the rows kernel (MakeRowsPlan) for p's shape and launches it: 4-bit weights in the rows
// layout. cluster / warps_n / depth / occupancy > 0 force the plan's choice.
inline ffi::Error RowsPlanAndLaunch(GemvParams& p, ffi::DataType dtype, Fusion fusion, int64_t block_size,
                                    int64_t cluster, int64_t warps_n, int64_t depth, int64_t occupancy,
                                    bool pdl, cudaStream_t stream, const char* op) {
  const Plan plan = MakeRowsPlan(p.m, p.n_rows, p.k, block_size, fusion.gated, fusion.norm, Sm90(), cluster,
                                 warps_n, depth, occupancy);
  return LaunchChecked(p, plan, dtype, op, [&](auto t) {
    return LaunchRows<decltype(t)>(p, plan, fusion, pdl, stream);
  });
}

// Plans the slots kernel on the record layout (MakeRecordPlan) for p's shape and launches it.
inline ffi::Error RecordPlanAndLaunch(GemvParams& p, ffi::DataType dtype, Fusion fusion, int64_t block_size,
                                      bool pdl, cudaStream_t stream, const char* op) {
  const Plan plan = MakeRecordPlan(p.m, p.n_rows, p.k, block_size, fusion.gated, fusion.norm, Sm90());
  return LaunchChecked(p, plan, dtype, op, [&](auto t) {
    return LaunchRecord<decltype(t)>(p, plan, fusion, pdl, stream);
  });
}

// The optional operands every GEMV handler takes (bias [n_rows], residual [m, n_out], RMS-norm
// weight [k], all of x's dtype): checks what guards memory and points p at them.
inline std::string ConfigureExtras(GemvParams& p, ffi::DataType dtype, const ffi::AnyBuffer& bias,
                                   const ffi::AnyBuffer& residual, const ffi::AnyBuffer& norm_weight,
                                   bool has_bias, bool has_residual, bool has_norm) {
  auto is = [&](const ffi::AnyBuffer& b, std::initializer_list<int64_t> dims) {
    if (b.element_type() != dtype || b.dimensions().size() != dims.size()) return false;
    size_t i = 0;
    for (int64_t d : dims) {
      if (b.dimensions()[i++] != d) return false;
    }
    return true;
  };
  p.bias = p.residual = p.gamma = nullptr;
  if (has_bias) {
    if (!is(bias, {p.n_rows})) return "bias must be [N] of x's dtype";
    p.bias = bias.untyped_data();
  }
  if (has_residual) {
    if (!is(residual, {p.m, p.n_out})) return "residual must be [M, N_out] of x's dtype";
    p.residual = residual.untyped_data();
  }
  if (has_norm) {
    if (!is(norm_weight, {p.k})) return "norm_weight must be [K] of x's dtype";
    p.gamma = norm_weight.untyped_data();
  }
  return "";
}

}  // namespace joa::gemv
