// gated_mlp: the gated MLP of one decode row in one launch (ffi/kernels/gemv/mlp_row.cuh):
// y = round(round(h W_down^T) + residual), h = round(silu(round(n W_gate^T)) * round(n W_up^T)),
// n = round(RMS-normed x * norm_weight) or x; the semantics of linear(gated) then linear(residual)
// (jax_onnx_attn.ops.reference.linear); the K split adds in another order (not the two calls'
// bits), the N split (the two-phase row chain, kernels/gemv/row_chain.cuh) in theirs.
//
// x [1, H] T (f16 / bf16), w_gate_up [2 I, H] T (interleave_gate_up), w_down [H, I] T,
// norm_weight [H] T, residual [1, H] T (placeholders when absent) -> y [1, H] T, workspace f32 of
// _ffi.gated_mlp_workspace elements (the K split's partial sums [grid, H], the N split's h; a
// result XLA allocates, discarded). grid: the CTAs, from _ffi.gated_mlp_grid for the split; every
// CTA must be resident at once (a cooperative launch, else it fails).
#include <string>
#include <utility>

#include "common/ffi.h"  // cuda_runtime.h first: mlp_row.h and row_chain.h then declare the launches
#include "kernels/gemv/mlp_row.h"
#include "kernels/gemv/row_chain.h"

namespace joa {
namespace {

// A launch's error as this call's (cleared from the thread's CUDA state), or Success.
ffi::Error LaunchResult(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  cudaGetLastError();
  return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(err) +
                              (err == cudaErrorCooperativeLaunchTooLarge
                                   ? " (the grid's CTAs do not all fit on the GPU at once)" : ""));
}

// The dense gated MLP's weights, output and norm weight against x's H and dtype (`of`: the input
// whose dtype they share): w_gate_up [2 I, H], w_down [H, I], y [1, H], norm_weight [H] when
// has_norm. Sets inter; the first bad operand's message, or "".
std::string CheckMlpOperands(AnyBuffer w_gate_up, AnyBuffer w_down, AnyBuffer norm_weight, AnyResult& y, int64_t h,
                             ffi::DataType dtype, const std::string& of, bool has_norm, int64_t& inter) {
  auto gd = w_gate_up.dimensions();
  if (gd.size() != 2 || gd[1] != h || gd[0] % 2 != 0 || w_gate_up.element_type() != dtype) {
    return "w_gate_up must be [2 I, H] in " + of + "'s dtype";
  }
  inter = gd[0] / 2;
  if (!HasShape(w_down, {h, inter}) || w_down.element_type() != dtype) {
    return "w_down must be [H, I] in " + of + "'s dtype";
  }
  if (!HasShape(*y, {1, h}) || y->element_type() != dtype) return "y must be [1, H] in " + of + "'s dtype";
  if (has_norm && (!HasShape(norm_weight, {h}) || norm_weight.element_type() != dtype)) {
    return "norm_weight must be [H] in " + of + "'s dtype";
  }
  return "";
}

// "" when a workspace of `have` f32 elements holds `need`, else the message.
std::string CheckWorkspace(int64_t have, int64_t need) {
  if (have >= need) return "";
  return "workspace has " + std::to_string(have) + " f32 elements, needs " + std::to_string(need);
}

ffi::Error GatedMlpImpl(cudaStream_t stream, AnyBuffer x, AnyBuffer w_gate_up, AnyBuffer w_down,
                        AnyBuffer norm_weight, AnyBuffer residual, AnyResult y,
                        ffi::Result<ffi::Buffer<ffi::F32>> workspace, bool has_norm, bool has_residual,
                        float eps, int64_t grid, bool n_split) {
  auto fail = [](const std::string& what) { return InvalidArgument("gated_mlp: " + what); };
  const ffi::DataType dtype = x.element_type();
  if (dtype != ffi::DataType::F16 && dtype != ffi::DataType::BF16) return fail("x must be f16 or bf16");
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[0] != 1) return fail("x must be [1, H] (one decode row)");
  const int64_t h = xd[1];
  int64_t inter = 0;
  const std::string bad = CheckMlpOperands(w_gate_up, w_down, norm_weight, y, h, dtype, "x", has_norm, inter);
  if (!bad.empty()) return fail(bad);
  if (has_residual && (!HasShape(residual, {1, h}) || residual.element_type() != dtype)) {
    return fail("residual must be [1, H] in x's dtype");
  }
  if (h > (int64_t(1) << 20) || inter > (int64_t(1) << 24) || grid < 1 || grid > 4096 ||
      !gemv::MlpRowTakes(int(h), int(inter), int(grid), n_split)) {
    return fail("H=" + std::to_string(h) + ", I=" + std::to_string(inter) + " on " + std::to_string(grid) +
                " CTAs is not a geometry the kernel takes (_ffi.gated_mlp_grid, " + (n_split ? "N" : "K") +
                " split)");
  }
  const std::string short_ws = CheckWorkspace(int64_t(workspace->element_count()),
                                              gemv::MlpRowWorkspaceElems(int(h), int(inter), int(grid), n_split));
  if (!short_ws.empty()) return fail(short_ws);
  const void* gamma = has_norm ? norm_weight.untyped_data() : nullptr;
  const void* res = has_residual ? residual.untyped_data() : nullptr;
  const bool bf16 = dtype == ffi::DataType::BF16;
  if (n_split) {
    gemv::RowChainParams c = gemv::GatedMlpChain(int(h), int(inter), x.untyped_data(), gamma, w_gate_up.untyped_data(),
                                                 w_down.untyped_data(), res, workspace->typed_data(), y->untyped_data());
    c.eps = eps;
    return LaunchResult("gated_mlp", gemv::LaunchRowChain(c, bf16, int(grid), stream));
  }
  gemv::MlpRowParams p{};
  p.x = x.untyped_data();
  p.gamma = gamma;
  p.w_gu = w_gate_up.untyped_data();
  p.w_down = w_down.untyped_data();
  p.residual = res;
  p.y = y->untyped_data();
  p.partials = workspace->typed_data();
  p.eps = eps;
  p.h = int(h);
  p.inter = int(inter);
  p.tiles_per_cta = int(inter / 8 / grid);
  return LaunchResult("gated_mlp", gemv::LaunchMlpRow(p, bf16, has_norm, int(grid), stream));
}

// out_mlp: the attention's output projection and the gated MLP of one decode row in one launch
// (kernels/gemv/row_chain.cuh, three phases): x1 = round(a W_o^T) + x, then y = gated_mlp(x1) with
// x1 as its residual; the semantics of linear(a, w_o, residual=x) then gated_mlp(..., residual=x1),
// and at the dense row kernel's warps their bits (the MLP's as two GEMVs, the N split's).
//
// a [1, Ho] T, w_o [H, Ho] T, x [1, H] T, w_gate_up [2 I, H] T (interleave_gate_up), w_down [H, I] T,
// norm_weight [H] T (placeholder when absent) -> y [1, H] T, workspace f32 of _ffi.out_mlp_workspace
// elements (x1 then h, as T). grid: _ffi.out_mlp_grid's CTAs, all resident at once.
ffi::Error OutMlpImpl(cudaStream_t stream, AnyBuffer a, AnyBuffer w_o, AnyBuffer x, AnyBuffer w_gate_up,
                      AnyBuffer w_down, AnyBuffer norm_weight, AnyResult y,
                      ffi::Result<ffi::Buffer<ffi::F32>> workspace, bool has_norm, float eps, int64_t grid) {
  auto fail = [](const std::string& what) { return InvalidArgument("out_mlp: " + what); };
  const ffi::DataType dtype = a.element_type();
  if (dtype != ffi::DataType::F16 && dtype != ffi::DataType::BF16) return fail("a must be f16 or bf16");
  auto ad = a.dimensions(), xd = x.dimensions();
  if (ad.size() != 2 || ad[0] != 1) return fail("a must be [1, Ho] (one decode row)");
  if (xd.size() != 2 || xd[0] != 1 || x.element_type() != dtype) return fail("x must be [1, H] in a's dtype");
  const int64_t ho = ad[1], h = xd[1];
  if (!HasShape(w_o, {h, ho}) || w_o.element_type() != dtype) return fail("w_o must be [H, Ho] in a's dtype");
  int64_t inter = 0;
  const std::string bad = CheckMlpOperands(w_gate_up, w_down, norm_weight, y, h, dtype, "a", has_norm, inter);
  if (!bad.empty()) return fail(bad);
  auto bad_geometry = [&] {
    return fail("H=" + std::to_string(h) + ", Ho=" + std::to_string(ho) + ", I=" + std::to_string(inter) + " on " +
                std::to_string(grid) + " CTAs is not a geometry the kernel takes (_ffi.out_mlp_grid)");
  };
  const int64_t limit = int64_t(1) << 24;
  if (h >= limit || ho >= limit || inter >= limit || grid < 1 || grid > 4096) return bad_geometry();
  const std::string short_ws =
      CheckWorkspace(int64_t(workspace->element_count()), gemv::OutMlpWorkspaceElems(int(h), int(inter)));
  if (!short_ws.empty()) return fail(short_ws);
  // x1 (H of T) then h (I of T) in the workspace.
  void* x1 = workspace->typed_data();
  gemv::RowChainParams p = gemv::OutMlpChain(
      int(h), int(ho), int(inter), a.untyped_data(), w_o.untyped_data(), x.untyped_data(),
      has_norm ? norm_weight.untyped_data() : nullptr, w_gate_up.untyped_data(), w_down.untyped_data(), x1,
      static_cast<char*>(x1) + h * 2, y->untyped_data());
  p.eps = eps;
  if (!gemv::RowChainFits<gemv::kRowChainWarps>(p, int(grid))) return bad_geometry();
  return LaunchResult("out_mlp", gemv::LaunchRowChain(p, dtype == ffi::DataType::BF16, int(grid), stream));
}

}  // namespace
}  // namespace joa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaOutMlp, joa::OutMlpImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<joa::Stream>()
                                  .Arg<joa::AnyBuffer>()  // a [1, Ho]
                                  .Arg<joa::AnyBuffer>()  // w_o [H, Ho]
                                  .Arg<joa::AnyBuffer>()  // x [1, H]
                                  .Arg<joa::AnyBuffer>()  // w_gate_up [2 I, H]
                                  .Arg<joa::AnyBuffer>()  // w_down [H, I]
                                  .Arg<joa::AnyBuffer>()  // norm_weight [H] (or placeholder)
                                  .Ret<joa::AnyBuffer>()  // y [1, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // workspace
                                  .Attr<bool>("has_norm")
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("grid"),
                              JOA_COMMAND_BUFFER_SAFE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaGatedMlp, joa::GatedMlpImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<joa::Stream>()
                                  .Arg<joa::AnyBuffer>()  // x [1, H]
                                  .Arg<joa::AnyBuffer>()  // w_gate_up [2 I, H]
                                  .Arg<joa::AnyBuffer>()  // w_down [H, I]
                                  .Arg<joa::AnyBuffer>()  // norm_weight [H] (or placeholder)
                                  .Arg<joa::AnyBuffer>()  // residual [1, H] (or placeholder)
                                  .Ret<joa::AnyBuffer>()  // y [1, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // workspace
                                  .Attr<bool>("has_norm")
                                  .Attr<bool>("has_residual")
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("grid")
                                  .Attr<bool>("n_split"),
                              JOA_COMMAND_BUFFER_SAFE);
