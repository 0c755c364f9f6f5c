// linear_gqa_prepare: a GroupQueryAttention decode step's packed QKV projection and its step
// preparation (gqa_prepare) in one launch: the one-row GEMV kernels with QkvRotaryEpilogue
// (ffi/kernels/gemv/epilogue.cuh). Semantics: linear (or matmul_nbits, record layout) then
// gqa_prepare on a packed query with rotary (not interleaved), no q / k norm, a float cache.
//
// x [1, K] T (f16 / bf16; one decode row: B = S = 1), w with its rows in the rotary-pair order
// (jax_onnx_attn.ops.linear.rotary_pair_order): bits 16 [N, K] T, bits 4 uint8 [N / 16, K / 256,
// 2432] in the record layout (scales and zero points inside), N = (heads + 2 kv_heads) D; bias [N]
// T (same order), norm_weight [K] T (RMS-norm prologue), k_cache / v_cache [B, Hkv, C, D] T
// (aliased to results 1 and 2), seqlens_k int32 [B], cos / sin [max_position, R/2] T,
// position_ids int32 [B, S] (each optional operand a placeholder when absent)
//   -> q [B, N, S, D], k_cache, v_cache, status int32 [B] (gqa_prepare's).
// seqlens_k and position_ids are read on the device; the launch depends on static shapes only.
#include <initializer_list>
#include <string>
#include <utility>

#include "common/ffi.h"
#include "kernels/gemv/host.h"
#include "record/stage.h"

namespace joa {
namespace {

ffi::Error LinearGqaPrepareImpl(cudaStream_t stream, AnyBuffer x, AnyBuffer w, AnyBuffer bias,
                                AnyBuffer norm_weight, AnyBuffer k_cache, AnyBuffer v_cache,
                                Int32Buffer seqlens_k, AnyBuffer cos, AnyBuffer sin,
                                Int32Buffer position_ids, AnyResult q_out, AnyResult k_cache_out,
                                AnyResult v_cache_out, Int32Result status, int64_t num_heads,
                                int64_t kv_num_heads, int64_t bits, int64_t block_size, bool has_bias,
                                bool has_norm, bool has_position_ids, float eps, bool pdl) {
  constexpr const char* kOp = "linear_gqa_prepare";
  auto fail = [&](const std::string& what) { return InvalidArgument(std::string(kOp) + ": " + what); };
  const ffi::DataType dtype = x.element_type();
  if (dtype != ffi::DataType::F16 && dtype != ffi::DataType::BF16) return fail("x must be f16 or bf16");
  auto xd = x.dimensions(), cd = k_cache.dimensions();
  if (xd.size() != 2 || xd[0] != 1) return fail("x must be [1, K] (one decode row)");
  if (num_heads <= 0 || kv_num_heads <= 0) return fail("num_heads and kv_num_heads must be positive");
  if (cd.size() != 4 || cd[0] != 1 || cd[1] != kv_num_heads || k_cache.element_type() != dtype) {
    return fail("k_cache must be [1, Hkv, C, D] in x's dtype");
  }
  const int64_t k = xd[1], capacity = cd[2], d = cd[3];
  const int64_t n = (num_heads + 2 * kv_num_heads) * d;
  if (!HasShape(v_cache, {1, kv_num_heads, capacity, d}) || v_cache.element_type() != dtype) {
    return fail("v_cache must have k_cache's shape and dtype");
  }
  if (d < 16 || d % 16 != 0 || d > 256) return fail("head size must be a multiple of 16 up to 256");
  if (capacity < 1 || capacity > (int64_t(1) << 30)) return fail("cache capacity must be in [1, 2^30]");
  if (!HasShape(seqlens_k, {1})) return fail("seqlens_k must be int32 [1]");
  if (!HasShape(*q_out, {1, num_heads, 1, d}) || q_out->element_type() != dtype) {
    return fail("q must be [1, N, 1, D] in x's dtype");
  }
  if (!HasShape(*status, {1})) return fail("status must be int32 [1]");
  auto rd = cos.dimensions();
  if (rd.size() != 2 || cos.element_type() != dtype || sin.element_type() != dtype || !HasShape(sin, {rd[0], rd[1]})) {
    return fail("cos_cache and sin_cache must both be [max_position, R/2] in x's dtype");
  }
  const int64_t half = rd[1], max_position = rd[0];
  if (half < 8 || half % 8 != 0 || 2 * half > d || max_position < 1 || max_position > (int64_t(1) << 30)) {
    return fail("cos_cache must be [max_position >= 1, R/2] with R/2 a multiple of 8 and R <= D");
  }
  if (has_position_ids && !HasShape(position_ids, {1, 1})) return fail("position_ids must be int32 [1, 1]");

  gemv::GemvParams p{};
  p.m = 1;
  p.k = int(k);
  p.n_rows = p.n_out = int(n);
  p.x = x.untyped_data();
  p.w = w.untyped_data();
  p.y = nullptr;  // the epilogue stores to q / the caches
  p.eps = eps;
  AnyBuffer none = x;  // ConfigureExtras checks only what is given: no residual here
  std::string err = gemv::ConfigureExtras(p, dtype, bias, none, norm_weight, has_bias, false, has_norm);
  if (!err.empty()) return fail(err);
  gemv::QkvRotaryParams& q = p.qkv;
  q.cos = cos.untyped_data();
  q.sin = sin.untyped_data();
  q.seqlens = seqlens_k.typed_data();
  q.position_ids = has_position_ids ? position_ids.typed_data() : nullptr;
  q.q_out = q_out->untyped_data();
  q.k_cache = k_cache_out->untyped_data();
  q.v_cache = v_cache_out->untyped_data();
  q.status = status->typed_data();
  q.seq = 1;
  q.heads = int(num_heads);
  q.kv_heads = int(kv_num_heads);
  q.head_dim = int(d);
  q.capacity = int(capacity);
  q.rotary_half = int(half);
  q.max_position = int(max_position);

  gemv::Plan plan;
  if (bits == 16) {
    if (w.element_type() != dtype || !HasShape(w, {n, k})) return fail("w must be [N, K] in x's dtype, N = (N_q + 2 Hkv) D");
    plan = gemv::MakePlan(1, n, k, 16, /*gated=*/false, has_norm, gemv::Sm90(), 0, 0, false, 0, /*slots=*/true);
    if (plan.error.empty() && !plan.dense_row) plan.error = "the shape has no dense row plan (K a multiple of 512)";
  } else if (bits == 4) {
    if (w.element_type() != ffi::DataType::U8 || n % gemv::kRecordRows != 0 || k % gemv::kRecordK != 0 ||
        !HasShape(w, {n / gemv::kRecordRows, k / gemv::kRecordK, gemv::kRecordBytes})) {
      return fail("w must be uint8 [N / 16, K / 256, 2432] (the record layout)");
    }
    if (block_size < 32 || block_size > (int64_t(1) << 20) || (block_size & (block_size - 1)) || k % block_size != 0) {
      return fail("block_size must be a power of two >= 32 dividing K");
    }
    p.k_blocks = int(k / block_size);
    while ((int64_t(1) << p.block_shift) < block_size) ++p.block_shift;
    plan = gemv::MakeRecordPlan(1, n, k, block_size, /*gated=*/false, has_norm, gemv::Sm90());
  } else {
    return fail("bits must be 16 (dense) or 4 (record layout)");
  }
  return gemv::LaunchChecked(p, plan, dtype, kOp, [&](auto t) {
    return gemv::LaunchQkvRotary<decltype(t)>(p, plan, has_norm, pdl, stream);
  });
}

// The operands and attributes, after the stage's context (execute: the stream; record: XLA's
// record context): one list for both stages.
template <class Binding>
auto LinearGqaPrepareOperands(Binding binding) {
  return std::move(binding)
      .template Arg<joa::AnyBuffer>()    // x [1, K]
      .template Arg<joa::AnyBuffer>()    // w (rotary-pair order)
      .template Arg<joa::AnyBuffer>()    // bias [N] (or placeholder)
      .template Arg<joa::AnyBuffer>()    // norm_weight [K] (or placeholder)
      .template Arg<joa::AnyBuffer>()    // k_cache [B, Hkv, C, D]
      .template Arg<joa::AnyBuffer>()    // v_cache
      .template Arg<joa::Int32Buffer>()  // seqlens_k [B]
      .template Arg<joa::AnyBuffer>()    // cos_cache [max_position, R/2]
      .template Arg<joa::AnyBuffer>()    // sin_cache
      .template Arg<joa::Int32Buffer>()  // position_ids [B, S] (or placeholder)
      .template Ret<joa::AnyBuffer>()    // q [B, N, S, D]
      .template Ret<joa::AnyBuffer>()    // k_cache (aliased)
      .template Ret<joa::AnyBuffer>()    // v_cache (aliased)
      .template Ret<joa::Int32Buffer>()  // status [B]
      .template Attr<int64_t>("num_heads")
      .template Attr<int64_t>("kv_num_heads")
      .template Attr<int64_t>("bits")
      .template Attr<int64_t>("block_size")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("has_norm")
      .template Attr<bool>("has_position_ids")
      .template Attr<float>("eps")
      .template Attr<bool>("pdl");
}

}  // namespace
}  // namespace joa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaLinearGqaPrepare, joa::LinearGqaPrepareImpl,
                              joa::LinearGqaPrepareOperands(xla::ffi::Ffi::Bind().Ctx<joa::Stream>()),
                              JOA_COMMAND_BUFFER_SAFE);

#if JOA_HAVE_FFI_RECORD
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JoaLinearGqaPrepareRecord, joa::record::Stage<joa::LinearGqaPrepareImpl>::Record,
    joa::LinearGqaPrepareOperands(xla::ffi::Ffi::BindRecord().Ctx<joa::record::RecordCtx>()));
#endif
