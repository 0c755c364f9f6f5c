// Probe: does jaxlib 0.11.2's XLA call an FFI handler's record stage (kernel nodes in the command
// buffer, programmatic-dependent-launch edges between calls), and what does a call boundary cost
// then against today's stream-captured child graphs? docs/ffi-record-stage.md is the memo this
// tests. A plain C ABI (ctypes), no nanobind: run.py loads it.
//   nvcc -std=c++17 -O2 -shared -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a \
//     -I $(python3 -c "import jax.ffi;print(jax.ffi.include_dir())") record_probe.cu -o librecord_probe.so
//   nvcc -cubin -gencode arch=compute_90a,code=sm_90a stream_kernel.cu -o stream_kernel.cubin
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "stream_kernel.cuh"
#include "xla/ffi/api/ffi.h"
#include "xla/ffi/api/record_api.h"

namespace ffi = xla::ffi;

using RecordContext = ffi::internal::RecordContextBase<ffi::internal::ErrorPolicy>;
struct RecordExt : ffi::internal::RecordExtensionBase<RecordContext> {};

static constexpr int kThreads = 256;
static std::atomic<long> g_execute_calls{0}, g_record_creates{0}, g_record_updates{0};
static const XLA_FFI_Api* g_api = nullptr;
static std::string g_cubin;

static StreamParams Params(ffi::AnyBuffer w, ffi::AnyBuffer x_in, ffi::Result<ffi::AnyBuffer> x_out,
                           bool wait_first) {
  return StreamParams{static_cast<const float4*>(w.untyped_data()), (long long)(w.size_bytes() / 16),
                      static_cast<const float*>(x_in.untyped_data()),
                      static_cast<float*>(x_out->untyped_data()), wait_first ? 1 : 0};
}

static ffi::Error Check(ffi::AnyBuffer x_out, int64_t grid) {
  if (int64_t(x_out.size_bytes()) < grid * kThreads * 4)
    return ffi::Error::InvalidArgument("x_out holds fewer than grid * 256 floats");
  return ffi::Error::Success();
}

// Execute: today's path (XLA stream-captures this into a child graph inside a command buffer).
static ffi::Error StreamExecute(cudaStream_t stream, ffi::AnyBuffer w, ffi::AnyBuffer x_in,
                                ffi::Result<ffi::AnyBuffer> x_out, int64_t grid, bool pdl,
                                bool wait_first) {
  g_execute_calls++;
  if (ffi::Error e = Check(*x_out, grid); e.failure()) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(grid));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, joa_probe_stream, Params(w, x_in, x_out, wait_first));
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Record: the same kernel as a kernel node XLA adds itself (its predecessors become our node's
// dependencies, programmatic ones when pdl is set and they are kernels).
static ffi::Error StreamRecord(RecordContext rec, ffi::AnyBuffer w, ffi::AnyBuffer x_in,
                               ffi::Result<ffi::AnyBuffer> x_out, int64_t grid, bool pdl,
                               bool wait_first) {
  if (ffi::Error e = Check(*x_out, grid); e.failure()) return e;
  const StreamParams p = Params(w, x_in, x_out, wait_first);
  const std::vector<ffi::KernelArg> args = {ffi::HostValue{&p, sizeof(p)}};
  if (rec.action() == ffi::RecordAction::kCreate) {
    g_record_creates++;
    XLA_FFI_LaunchDims dims{{int32_t(grid), 1, 1}, {kThreads, 1, 1}, {0, 0, 0}};
    auto cmd = rec.CreateLaunch("joa_probe_stream", g_cubin.data(), g_cubin.size(), ffi::SourceFormat::kCubin,
                                dims, 0, pdl, args);
    if (cmd.has_error()) return cmd.error();
    return ffi::Error::Success();
  }
  g_record_updates++;
  return rec.UpdateLaunch(rec.commands()[0], args);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaStreamExecute, StreamExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("grid")
                                  .Attr<bool>("pdl")
                                  .Attr<bool>("wait_first"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaStreamRecord, StreamRecord,
                              ffi::Ffi::BindRecord()
                                  .Ctx<ffi::Extension<RecordExt>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("grid")
                                  .Attr<bool>("pdl")
                                  .Attr<bool>("wait_first"));

// A no-op handler whose only job is to see a call frame and keep the running plugin's XLA_FFI_Api*.
static ffi::Error Noop(ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }
XLA_FFI_DEFINE_HANDLER(NoopTyped, Noop, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

extern "C" {

XLA_FFI_Error* JoaApiProbe(XLA_FFI_CallFrame* frame) {
  if (frame != nullptr && frame->api != nullptr) g_api = frame->api;
  return NoopTyped(frame);
}

int joa_api_minor() { return g_api ? g_api->api_version.minor_version : -1; }

long joa_execute_calls() { return g_execute_calls.load(); }
long joa_record_creates() { return g_record_creates.load(); }
long joa_record_updates() { return g_record_updates.load(); }

// Registers `name` with execute + record straight into the plugin's registry (jax 0.11.2's
// register_ffi_target drops a bundle's record field). Returns "" or the error.
const char* joa_register_record(const char* name, const char* cubin_path) {
  static std::string message;
  if (g_api == nullptr) return (message = "no XLA_FFI_Api* captured yet").c_str();
  std::ifstream f(cubin_path, std::ios::binary);
  g_cubin.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  if (g_cubin.empty()) return (message = std::string("cannot read ") + cubin_path).c_str();
  XLA_FFI_Handler_Bundle bundle{nullptr, nullptr, nullptr, JoaStreamExecute, JoaStreamRecord};
  XLA_FFI_Error* err = ffi::Ffi::RegisterStaticHandler(g_api, name, "CUDA", bundle,
                                                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
  if (err == nullptr) return (message = "").c_str();
  const ffi::internal::ErrorDetails d = ffi::internal::GetErrorDetails(g_api, err);
  ffi::internal::DestroyError(g_api, err);
  return (message = d.message).c_str();
}

}  // extern "C"
