// nanobind module jax_onnx_attn._ffi: the FFI handler capsules and what was built.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "common/status.h"
#include "handlers.h"
#include "matmul/plan_binding.h"

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

  m.def("build_info", []() {
    nb::dict info;
    info["jaxlib_headers"] = JOA_JAXLIB_VERSION;
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

  m.def("status_flags", []() {
    nb::dict flags;
    flags["OK"] = joa::status::kOk;
    flags["KV_WRITE_OUT_OF_RANGE"] = joa::status::kKvWriteOutOfRange;
    return flags;
  }, "The device status flags the kernels write (see jax_onnx_attn/ops/status.py).");
}
