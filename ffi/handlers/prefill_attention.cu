// prefill_attention: attention of long prompts on the Hopper prefill engine (ffi/kernels/prefill/:
// TMA + wgmma + warp specialisation), sm_90 only.
//
// q [B, Hq, S, D], k / v [B, Hkv, T, D] of q's dtype (f16 / bf16; D in prefill::kHeadDims),
// q_len / kv_len int32 [B] (valid query rows / keys per batch row, read on the device, clamped to
// [0, S] / [0, T]) -> y [B, Hq, S, D]. Query row i < q_len[b] sits at position
// kv_len[b] - q_len[b] + i (bottom-right aligned); rows past q_len[b] and rows that see no key
// are 0. left / right (>= 0; -1: unbounded): local windows, key j hidden from a row at position p
// when p - j > left or j - p > right (the decode engine's rule). schedule: an index of
// prefill::kScheduleNames / kScheduleSpecs, the consumers' order of work (the three plain schedules
// give the same bits) and its tuning (params.h Tune). sink f32 [Hq] (a placeholder when has_sink is
// false): a per-query-head extra logit in the softmax's max and denominator, no value row.
// softcap > 0: logits x -> softcap * tanh(x / softcap) before the mask (0: off).
// splits (1..prefill::kMaxSplits): split-KV, each CTA's key tiles cut into that many ranges whose
// partials combine.cuh merges (Python passes kernels/prefill/plan.h's choice or an override); > 1
// only with the head size's default schedule (TilingFor(D).schedule: the split kernels');
// workspace f32 (a result, discarded): plan.h WorkspaceElems elements at least when splits > 1.
// persistent: one CTA an SM looping over the tiles where the call runs the head size's default
// schedule unsplit and its tiling holds two Q tiles (prefill.h Launch), else ignored; the same bits.
// Read-only on q, k, v.
#include <cstdint>
#include <string>

#include "common/ffi.h"
#include "common/device.h"
#include "common/variant.h"
#include "kernels/prefill/params.h"
#include "kernels/prefill/plan.h"
#include "kernels/prefill/prefill.h"

// Host side: shapes and the variant into PrefillParams; the launch for the dtype and head size.
namespace joa::prefill {

// Fills shapes and the variant of `p` for q [B, Hq, S, D], k / v [B, Hkv, T, D] (pointers and
// lengths are the caller's). Returns an error message or "".
inline std::string Configure(PrefillParams& p, int64_t batch, int64_t q_heads, int64_t q_rows, int64_t head_dim,
                             int64_t kv_heads, int64_t kv_rows, float scale, float softcap, bool causal,
                             int64_t left, int64_t right, int64_t splits) {
  bool supported = false;
  for (int d : kHeadDims) supported = supported || d == head_dim;
  if (!supported) {
    std::string dims;
    for (int d : kHeadDims) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    return "head dim " + std::to_string(head_dim) + " is not one the engine is compiled for (" + dims + ")";
  }
  if (kv_heads <= 0 || q_heads % kv_heads != 0) return "query heads must be a multiple of KV heads";
  constexpr int64_t kMaxRows = int64_t(1) << 31;
  // TMA row coordinates and the engine's row arithmetic are 32-bit.
  if (batch * q_heads * q_rows >= kMaxRows || batch * kv_heads * kv_rows + kMaxBlockN >= kMaxRows) {
    return "more than 2^31 query or key rows";
  }
  if (splits < 1 || splits > kMaxSplits) {
    return "splits must be 1.." + std::to_string(kMaxSplits) + ", got " + std::to_string(splits);
  }
  const int64_t rows = (q_heads / kv_heads) * q_rows;
  // kBlockM: the smallest CTA tile (kTuneM192's 192 rows make fewer CTAs).
  if (batch * kv_heads * ((rows + kBlockM - 1) / kBlockM) * splits > int64_t(0x7fffffff)) {
    return "too many query rows for the grid";
  }
  p.batch = int(batch);
  p.q_heads = int(q_heads);
  p.kv_heads = int(kv_heads);
  p.q_rows = int(q_rows);
  p.kv_rows = int(kv_rows);
  p.head_dim = int(head_dim);
  p.group = int(q_heads / kv_heads);
  p.rows = int(rows);
  p.variant = MakeVariant(VariantAttrs{scale, softcap > 0.f ? softcap : 0.f, causal, left, right, 0});
  p.splits = int(splits);
  p.part_o = p.part_lse = nullptr;
  return "";
}

// Points the split partials at the workspace (checking its size against plan.h's layout).
inline std::string SetWorkspace(PrefillParams& p, float* workspace, int64_t workspace_elems) {
  const int64_t need = WorkspaceElems(p.batch, p.kv_heads, p.splits, p.rows, p.head_dim);
  if (workspace_elems < need) {
    return "workspace has " + std::to_string(workspace_elems) + " f32 elements, needs " + std::to_string(need);
  }
  if (p.splits > 1) {
    p.part_o = workspace;
    p.part_lse = workspace + int64_t(p.batch) * p.kv_heads * p.splits * p.rows * p.head_dim;
  }
  return "";
}

inline ffi::Error LaunchPrefill(const PrefillParams& p, ffi::DataType dtype, const void* q, const void* k,
                                const void* v, ScheduleSpec schedule, bool persistent, cudaStream_t stream,
                                const char* op) {
  if (p.batch == 0 || p.rows == 0) return ffi::Error::Success();
  const ComputeCapability cc = CurrentComputeCapability();
  if (cc.major != 9 || cc.minor != 0) {
    return InvalidArgument(std::string(op) + ": the prefill engine runs on sm_90 (H100 / H200) only");
  }
  // The instance for the element type `t` stands for and the head size (one of kHeadDims, checked
  // by Configure; prefill.h's JOA_PREFILL_INSTANCES).
  auto launch = [&](auto t) {
    using T = decltype(t);
    switch (p.head_dim) {
      case 64: return Launch<T, 64>(p, q, k, v, schedule, persistent, stream);
      case 80: return Launch<T, 80>(p, q, k, v, schedule, persistent, stream);
      case 96: return Launch<T, 96>(p, q, k, v, schedule, persistent, stream);
      case 128: return Launch<T, 128>(p, q, k, v, schedule, persistent, stream);
      case 256: return Launch<T, 256>(p, q, k, v, schedule, persistent, stream);
      default: return cudaErrorInvalidValue;
    }
  };
  const bool half = dtype == ffi::DataType::F16;
  if (!half && dtype != ffi::DataType::BF16) {
    return InvalidArgument(std::string(op) + ": the prefill engine takes f16 and bf16 only");
  }
  const cudaError_t err = half ? launch(__half{}) : launch(__nv_bfloat16{});
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace joa::prefill

namespace joa {
namespace {

using F32Buffer = ffi::Buffer<ffi::F32>;
using F32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

ffi::Error PrefillAttentionImpl(cudaStream_t stream, AnyBuffer q, AnyBuffer k, AnyBuffer v, Int32Buffer q_len,
                                Int32Buffer kv_len, F32Buffer sink, AnyResult y, F32Result workspace, float scale,
                                float softcap, bool causal, int64_t left, int64_t right, bool has_sink,
                                int64_t schedule, int64_t splits, bool persistent) {
  constexpr const char* kOp = "prefill_attention";
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return InvalidArgument("prefill_attention: q, k and v must be rank 4");
  }
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      y->element_type() != q.element_type()) {
    return InvalidArgument("prefill_attention: k, v and y must have q's dtype");
  }
  for (int i = 0; i < 4; ++i) {
    if (kd[i] != vd[i]) return InvalidArgument("prefill_attention: k and v shapes differ");
  }
  if (kd[0] != qd[0] || kd[3] != qd[3]) {
    return InvalidArgument("prefill_attention: k / v must be [B, Hkv, T, D] with q's B and D");
  }
  for (const Int32Buffer* len : {&q_len, &kv_len}) {
    if (len->dimensions().size() != 1 || len->dimensions()[0] != qd[0]) {
      return InvalidArgument("prefill_attention: q_len and kv_len must be int32 [B]");
    }
  }
  auto yd = y->dimensions();
  if (yd.size() != 4 || yd[0] != qd[0] || yd[1] != qd[1] || yd[2] != qd[2] || yd[3] != qd[3]) {
    return InvalidArgument("prefill_attention: y must be [B, Hq, S, D]");
  }
  if (schedule < 0 || schedule >= prefill::kNumSchedules) {
    return InvalidArgument("prefill_attention: schedule must index prefill::kScheduleNames (0 serial, 1 overlap, "
                           "2 pingpong, 3.. tuned pingpong), got " + std::to_string(schedule));
  }
  prefill::PrefillParams p{};
  std::string err =
      prefill::Configure(p, qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], scale, softcap, causal, left, right, splits);
  if (err.empty() && has_sink) err = SetSink(p.variant, sink, qd[1]);
  if (err.empty() && splits > 1 && schedule != prefill::TilingFor(int(qd[3])).schedule) {
    err = std::string("split-KV (splits > 1) runs the head size's default schedule ") +
          prefill::kScheduleNames[prefill::TilingFor(int(qd[3])).schedule] + ", got " +
          prefill::kScheduleNames[schedule];
  }
  if (err.empty()) err = prefill::SetWorkspace(p, workspace->typed_data(), int64_t(workspace->element_count()));
  if (!err.empty()) return InvalidArgument(std::string(kOp) + ": " + err);
  p.y = y->untyped_data();
  p.q_len = q_len.typed_data();
  p.kv_len = kv_len.typed_data();
  return prefill::LaunchPrefill(p, q.element_type(), q.untyped_data(), k.untyped_data(), v.untyped_data(),
                                prefill::kScheduleSpecs[schedule], persistent, stream, kOp);
}

}  // namespace
}  // namespace joa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaPrefillAttention, joa::PrefillAttentionImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<joa::Stream>()
                                  .Arg<joa::AnyBuffer>()    // q
                                  .Arg<joa::AnyBuffer>()    // k
                                  .Arg<joa::AnyBuffer>()    // v
                                  .Arg<joa::Int32Buffer>()  // q_len
                                  .Arg<joa::Int32Buffer>()  // kv_len
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // sink (or placeholder)
                                  .Ret<joa::AnyBuffer>()    // y
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // workspace
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Attr<bool>("has_sink")
                                  .Attr<int64_t>("schedule")
                                  .Attr<int64_t>("splits")
                                  .Attr<bool>("persistent"),
                              JOA_COMMAND_BUFFER_SAFE);
