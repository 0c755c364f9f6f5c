// linear: y[M, N_out] = x[M, K] W[N, K]^T on the weight-streaming GEMV engine (ffi/kernels/gemv/),
// M <= 32, f16 / bf16, with the optional fusions: RMS-norm prologue (norm_weight [K]), bias [N],
// residual [M, N_out], gated SiLU (W rows interleaved gate / up in blocks of 8; N_out = N / 2).
// Placeholders stand for absent operands (has_* false). cluster / warps_k > 0 override the plan
// (sweeps); pdl launches as a programmatic dependent (W read before the previous kernel ends);
// slots lets one row take the dense row kernel (kernels/gemv/dense_row.cuh) where the plan has it.
#include <string>
#include <utility>

#include "common/ffi.h"
#include "kernels/gemv/host.h"
#include "record/stage.h"

namespace joa {
namespace {

ffi::Error LinearImpl(cudaStream_t stream, AnyBuffer x, AnyBuffer w, AnyBuffer bias, AnyBuffer residual,
                      AnyBuffer norm_weight, AnyResult y, bool has_bias, bool has_residual,
                      bool has_norm, bool gated, float eps, int64_t cluster, int64_t warps_k, bool pdl,
                      bool slots) {
  constexpr const char* kOp = "linear";
  const ffi::DataType dtype = x.element_type();
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return InvalidArgument("linear: x, w and y must be rank 2");
  }
  if (w.element_type() != dtype || y->element_type() != dtype) {
    return InvalidArgument("linear: x, w and y must share a dtype");
  }
  if (wd[1] != xd[1]) return InvalidArgument("linear: w must be [N, K] with x's K");
  const int64_t n_out = gated ? wd[0] / 2 : wd[0];
  if (yd[0] != xd[0] || yd[1] != n_out) return InvalidArgument("linear: y must be [M, N_out]");
  if (xd[0] < 1 || xd[0] > gemv::kMaxM || wd[0] > (int64_t(1) << 30) || xd[1] > (int64_t(1) << 30)) {
    return InvalidArgument("linear: shape out of range");
  }
  gemv::GemvParams p{};
  p.m = int(xd[0]);
  p.k = int(xd[1]);
  p.n_rows = int(wd[0]);
  p.n_out = int(n_out);
  p.x = x.untyped_data();
  p.w = w.untyped_data();
  p.y = y->untyped_data();
  p.eps = eps;
  std::string err = gemv::ConfigureExtras(p, dtype, bias, residual, norm_weight, has_bias,
                                          has_residual, has_norm);
  if (!err.empty()) return InvalidArgument(std::string(kOp) + ": " + err);
  return gemv::PlanAndLaunch(p, dtype, 16, gemv::Fusion{gated, has_norm}, cluster, warps_k,
                             /*wide=*/false, pdl, stream, kOp, /*block_size=*/0, slots);
}


// linear's operands and attributes, after the stage's context (execute: the stream; record: XLA's
// record context): one list for both stages.
template <class Binding>
auto LinearOperands(Binding binding) {
  return std::move(binding)
      .template Arg<joa::AnyBuffer>()  // x [M, K]
      .template Arg<joa::AnyBuffer>()  // w [N, K]
      .template Arg<joa::AnyBuffer>()  // bias [N] (or placeholder)
      .template Arg<joa::AnyBuffer>()  // residual [M, N_out] (or placeholder)
      .template Arg<joa::AnyBuffer>()  // norm_weight [K] (or placeholder)
      .template Ret<joa::AnyBuffer>()  // y [M, N_out]
      .template Attr<bool>("has_bias")
      .template Attr<bool>("has_residual")
      .template Attr<bool>("has_norm")
      .template Attr<bool>("gated")
      .template Attr<float>("eps")
      .template Attr<int64_t>("cluster")
      .template Attr<int64_t>("warps_k")
      .template Attr<bool>("pdl")
      .template Attr<bool>("slots");
}
}  // namespace
}  // namespace joa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaLinear, joa::LinearImpl,
                              joa::LinearOperands(xla::ffi::Ffi::Bind().Ctx<joa::Stream>()),
                              JOA_COMMAND_BUFFER_SAFE);

#if JOA_HAVE_FFI_RECORD
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaLinearRecord, joa::record::Stage<joa::LinearImpl>::Record,
                              joa::LinearOperands(xla::ffi::Ffi::BindRecord().Ctx<joa::record::RecordCtx>()));
#endif
