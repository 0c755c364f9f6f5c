// nanobind module jax_onnx_attn._ffi: the FFI handler capsules and what was built.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <iterator>
#include <string>

#include "common/status.h"
#include "handlers.h"
#include "kernels/gemv/plan_binding.h"
#include "kernels/decode/plan.h"
#include "kernels/general/params.h"
#include "kernels/prefill/params.h"
#include "kernels/prefill/plan.h"
#if JOA_HAVE_FFI_RECORD
#include "record/registry.h"
#endif

namespace nb = nanobind;

NB_MODULE(_ffi, m) {
  m.doc() = "jax-onnx-attn CUDA kernels as XLA FFI handlers";

  m.def("registrations", []() {
    nb::dict targets;
#ifdef JOA_WITH_CUDA
    for (const auto& t : joa::kTargets) {
      targets[t.name] = nb::capsule(reinterpret_cast<void*>(t.handler));
    }
#endif
    return targets;
  }, "Short target name -> XLA FFI handler capsule (empty without CUDA).");

  // The record stage (ffi/record/): which targets have one, the probe that catches XLA's C API, and
  // their registration through it. Empty / None in a build against headers without the stage.
  m.def("record_targets", []() {
    nb::list names;
#if JOA_HAVE_FFI_RECORD
    for (const auto& t : joa::kRecordTargets) names.append(t.name);
#endif
    return names;
  }, "Short names of the targets with a record stage (empty when the build has none).");

  m.def("record_api_probe", []() -> nb::object {
#if JOA_HAVE_FFI_RECORD
    return nb::capsule(reinterpret_cast<void*>(joa::record::ApiProbe));
#else
    return nb::none();
#endif
  }, "The capsule of the handler that keeps XLA's C API pointer (register it first), or None.");

  m.def("register_record", [](const std::string& prefix) {
    nb::dict errors;
#if JOA_HAVE_FFI_RECORD
    for (const auto& t : joa::kRecordTargets) {
      errors[t.name] = joa::record::Register(prefix + t.name, t.execute, t.record);
    }
#endif
    return errors;
  }, nb::arg("prefix"),
     "Registers each record target as prefix + name through XLA's C API: {name: '' or the error}.");

  m.def("record_status", []() {
    nb::dict out;
#if JOA_HAVE_FFI_RECORD
    const joa::record::Counters c = joa::record::GetCounters();
    out["api_minor_version"] = joa::record::ApiMinorVersion();
    out["creates"] = c.creates;
    out["updates"] = c.updates;
    out["fallbacks"] = c.fallbacks;
    out["last_fallback"] = c.last_fallback;
#endif
    return out;
  }, "What the record stages did in this process (empty without the stage).");

  m.def("build_info", []() {
    nb::dict info;
    info["jaxlib_headers"] = JOA_JAXLIB_VERSION;
#if JOA_HAVE_FFI_RECORD
    info["ffi_record"] = true;
#else
    info["ffi_record"] = false;
#endif
#ifdef JOA_WITH_CUDA
    info["cuda"] = true;
    info["cuda_version"] = JOA_CUDA_VERSION;
    nb::list archs;
    std::string all = JOA_CUDA_ARCHS;
    size_t begin = 0;
    while (begin <= all.size()) {
      size_t end = all.find(',', begin);
      if (end == std::string::npos) end = all.size();
      if (end > begin) archs.append(all.substr(begin, end - begin));
      begin = end + 1;
    }
    info["cuda_architectures"] = archs;
    info["reason"] = nb::none();
#else
    info["cuda"] = false;
    info["cuda_version"] = nb::none();
    info["cuda_architectures"] = nb::list();
    info["reason"] = JOA_CUDA_REASON;
#endif
    return info;
  }, "What the extension was built with.");

  joa::gemv::BindPlan(m);  // gemv_plan: the GEMV engine's launch plan (ffi/kernels/gemv/plan.h)
  // The kernels' limits and the decode plan, computed here from the headers the kernels compile
  // with (host-only C++: also in a build without CUDA). ops/cuda.py asks instead of re-deriving.
  m.def("limits", []() {
    nb::dict decode;
    decode["block_n"] = joa::decode::kBlockN;
    decode["max_splits"] = joa::decode::kMaxSplits;
    decode["max_cluster_splits"] = joa::decode::kMaxClusterSplits;
    nb::list head_dims;
    for (int d : joa::decode::kHeadDims) head_dims.append(d);
    decode["head_dims"] = head_dims;
    nb::list plans;
    for (const auto& c : joa::decode::kClusterPlans) plans.append(nb::make_tuple(c.size, c.max_tiles));
    decode["cluster_plans"] = plans;
    nb::list policies;
    for (const char* name : joa::decode::kPlanPolicyNames) policies.append(name);
    decode["plan_policies"] = policies;
    nb::list wave_clusters;  // [CTAs an SM - 1][cluster size - 1]
    for (const auto& row : joa::decode::kWaveClusters) {
      nb::list sizes;
      for (int16_t c : row) sizes.append(int(c));
      wave_clusters.append(sizes);
    }
    decode["wave_clusters"] = wave_clusters;
    decode["fit_max_tiles"] = joa::decode::kFitMaxTiles;
    decode["long_split_tiles"] = joa::decode::kLongSplitTiles;
    decode["long_split_max_splits"] = joa::decode::kLongSplitMaxSplits;
    decode["long_split_max_tiles"] = joa::decode::kLongSplitMaxTiles;
    decode["plan_sms"] = joa::decode::kPlanSms;
    decode["wide_tile_n"] = joa::decode::kWideTileN;
    nb::list wide_dims;
    for (int d : joa::decode::kWideTileHeadDims) wide_dims.append(d);
    decode["wide_tile_head_dims"] = wide_dims;
    nb::dict general;
    general["max_keys"] = joa::general::kMaxKeys;
    nb::list softmax;
    for (const char* name : joa::general::kSoftmaxTypeNames) softmax.append(name);
    general["softmax_types"] = softmax;
    nb::dict gemv;
    gemv["meta_tile_rows"] = joa::gemv::kMetaTileRows;
    gemv["rows_group"] = joa::gemv::kRowsGroup;
    gemv["record_rows"] = joa::gemv::kRecordRows;
    gemv["record_k"] = joa::gemv::kRecordK;
    gemv["record_w_bytes"] = joa::gemv::kRecordWBytes;
    gemv["record_bytes"] = joa::gemv::kRecordBytes;
    nb::dict prefill;
    nb::list prefill_dims;
    for (int d : joa::prefill::kHeadDims) prefill_dims.append(d);
    prefill["head_dims"] = prefill_dims;
    prefill["block_m"] = joa::prefill::kBlockM;
    // Per head size (params.h TilingFor): {d: {"padded", "block_n", "stages", "schedule"}}.
    nb::dict tiling;
    for (int d : joa::prefill::kHeadDims) {
      const joa::prefill::Tiling t = joa::prefill::TilingFor(d);
      nb::dict one;
      one["padded"] = t.padded;
      one["block_n"] = t.block_n;
      one["stages"] = t.stages;
      one["schedule"] = joa::prefill::kScheduleNames[t.schedule];
      tiling[nb::int_(d)] = one;
    }
    prefill["tiling"] = tiling;
    nb::list schedules;
    for (const char* name : joa::prefill::kScheduleNames) schedules.append(name);
    prefill["schedules"] = schedules;
    // Split-KV (kernels/prefill/plan.h).
    prefill["max_splits"] = joa::prefill::kMaxSplits;
    prefill["plan_sms"] = joa::prefill::kPlanSms;
    prefill["split_min_tiles"] = joa::prefill::kSplitMinTiles;
    prefill["split_full_percent"] = joa::prefill::kSplitFullPercent;
    prefill["split_slack_percent"] = joa::prefill::kSplitSlackPercent;
    nb::dict out;
    out["decode"] = decode;
    out["general"] = general;
    out["gemv"] = gemv;
    out["prefill"] = prefill;
    return out;
  }, "The kernels' limits: {'decode': {...}, 'general': {...}, 'gemv': {...}, 'prefill': {...}}.");

  m.def("decode_plan", [](int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t q_len,
                          int64_t capacity, int head_dim, int kv_bits, bool cluster_capable,
                          int64_t split_rows, int cluster, int policy, bool tile128, int quant_path) {
    if (batch < 0 || q_len < 0 || capacity < 1 || kv_heads < 1 || q_heads % kv_heads != 0) {
      throw nb::value_error("decode_plan: shapes out of range");
    }
    if (kv_bits != 0 && kv_bits != 4 && kv_bits != 8) throw nb::value_error("decode_plan: kv_bits must be 0, 4 or 8");
    if (split_rows < 0 || split_rows % joa::decode::kBlockN != 0) {
      throw nb::value_error("decode_plan: split_rows must be 0 (plan it) or a positive multiple of the block");
    }
    if (quant_path < 0 || quant_path > int(joa::decode::QuantPath::kRegs)) {
      throw nb::value_error("decode_plan: quant_path must be 0 (tiles), 1 (auto) or 2 (registers)");
    }
    if (policy < 0 || policy >= int(std::size(joa::decode::kPlanPolicyNames))) {
      throw nb::value_error("decode_plan: policy must index limits()['decode']['plan_policies']");
    }
    const joa::KvFormat format = kv_bits == 8 ? joa::KvFormat::kInt8 : kv_bits == 4 ? joa::KvFormat::kInt4
                                                                                : joa::KvFormat::kDense;
    const joa::decode::Plan p = joa::decode::MakePlan(batch, q_heads, kv_heads, q_len, capacity, head_dim,
                                                      format, cluster_capable, split_rows, cluster,
                                                      joa::decode::PlanPolicy(policy), tile128,
                                                      joa::decode::QuantPath(quant_path));
    nb::dict out;
    out["split_rows"] = p.split_rows;
    out["splits"] = p.splits;
    out["cluster"] = p.cluster;
    out["workspace_elems"] = p.workspace_elems;
    out["block_rows"] = p.block_rows;
    out["ctas_per_sm"] = p.ctas_per_sm;
    out["tile_rows"] = p.tile_rows;
    out["quant_regs"] = p.quant_regs;
    return out;
  }, nb::arg("batch"), nb::arg("q_heads"), nb::arg("kv_heads"), nb::arg("q_len"), nb::arg("capacity"),
     nb::arg("head_dim"), nb::arg("kv_bits") = 0, nb::arg("cluster_capable") = false,
     nb::arg("split_rows") = 0, nb::arg("cluster") = -1, nb::arg("policy") = 0, nb::arg("tile128") = false,
     nb::arg("quant_path") = 0,
     "The decode engine's plan for a call of these static shapes (kernels/decode/plan.h): "
     "split_rows 0 and cluster -1 let it choose; policy indexes limits()['decode']['plan_policies']; "
     "tile128: the wide KV tile's plan where it applies (tile_rows says which tile the engine runs); "
     "quant_path: an int8 / int4 cache's kernel, 0 the tile kernel, 2 the register-dequantising one, "
     "1 the faster for the call's size (plan.h QuantPath; the plan's quant_regs says which runs).");

  m.def("prefill_plan", [](int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t q_rows, int64_t kv_rows,
                           int head_dim, bool causal, int64_t left, int64_t right, int64_t splits) {
    bool supported = false;
    for (int d : joa::prefill::kHeadDims) supported = supported || d == head_dim;
    if (batch < 0 || q_rows < 0 || kv_rows < 0 || kv_heads < 1 || q_heads % kv_heads != 0 || !supported) {
      throw nb::value_error("prefill_plan: shapes out of range");
    }
    if (splits < 0 || splits > joa::prefill::kMaxSplits) {
      throw nb::value_error("prefill_plan: splits must be 0 (plan it) or 1..limits()['prefill']['max_splits']");
    }
    const joa::prefill::SplitPlan p = joa::prefill::MakeSplitPlan(batch, q_heads, kv_heads, q_rows, kv_rows,
                                                                  head_dim, causal, left, right, splits);
    nb::dict out;
    out["splits"] = p.splits;
    out["ctas"] = p.ctas;
    out["tiles"] = p.tiles;
    out["workspace_elems"] = p.workspace_elems;
    return out;
  }, nb::arg("batch"), nb::arg("q_heads"), nb::arg("kv_heads"), nb::arg("q_rows"), nb::arg("kv_rows"),
     nb::arg("head_dim"), nb::arg("causal") = true, nb::arg("left") = -1, nb::arg("right") = -1,
     nb::arg("splits") = 0,
     "The prefill engine's split-KV plan for a call of these static shapes (kernels/prefill/plan.h): "
     "splits 0 lets it choose; {'splits', 'ctas', 'tiles', 'workspace_elems'}.");

  m.def("status_flags", []() {
    nb::dict flags;
    flags["OK"] = joa::status::kOk;
    flags["KV_WRITE_OUT_OF_RANGE"] = joa::status::kKvWriteOutOfRange;
    return flags;
  }, "The device status flags the kernels write (see jax_onnx_attn/ops/status.py).");
}
