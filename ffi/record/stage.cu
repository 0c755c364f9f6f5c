// The record stage's host side: emitting recorded launches to XLA, finding a kernel's embedded
// image, and registering record targets through the captured XLA C API (stage.h, registry.h).
#if JOA_HAVE_FFI_RECORD

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "record/cubins.h"
#include "record/registry.h"
#include "record/stage.h"

namespace joa::record {
namespace {

std::atomic<const XLA_FFI_Api*> g_api{nullptr};
std::atomic<long> g_creates{0}, g_updates{0}, g_fallbacks{0};
std::mutex g_mutex;  // guards g_last_fallback and the image cache
std::string g_last_fallback;

// A kernel as XLA loads it: its (mangled) name and the cubin that holds it.
struct KernelImage {
  std::string name;
  const unsigned char* data = nullptr;
  size_t size = 0;
  std::string error;
};

// The name of a kernel our module launches through its host stub (the driver knows it; the
// runtime API does not say): cuFuncGetName, CUDA >= 12.3, reached without linking libcuda.
std::string KernelName(const void* kernel, std::string& error) {
  using GetName = CUresult (*)(const char**, CUfunction);
  static GetName get_name = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuFuncGetName", &fn, 12030, cudaEnableDefault, &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      return GetName(nullptr);
    }
    return reinterpret_cast<GetName>(fn);
  }();
  if (get_name == nullptr) {
    error = "the driver has no cuFuncGetName (CUDA >= 12.3)";
    return "";
  }
  cudaFunction_t f = nullptr;
  if (cudaError_t e = cudaGetFuncBySymbol(&f, kernel); e != cudaSuccess) {
    error = std::string("cudaGetFuncBySymbol: ") + cudaGetErrorString(e);
    return "";
  }
  const char* name = nullptr;
  if (get_name(&name, reinterpret_cast<CUfunction>(f)) != CUDA_SUCCESS || name == nullptr) {
    error = "cuFuncGetName failed";
    return "";
  }
  return name;
}

// The embedded cubin whose ELF string table names the kernel ("\0name\0").
const KernelImage& FindImage(const void* kernel) {
  std::lock_guard<std::mutex> lock(g_mutex);
  static std::map<const void*, KernelImage> cache;
  auto [it, inserted] = cache.try_emplace(kernel);
  KernelImage& image = it->second;
  if (!inserted) return image;
  image.name = KernelName(kernel, image.error);
  if (image.name.empty()) return image;
  const std::string needle = std::string(1, '\0') + image.name + std::string(1, '\0');
  for (size_t i = 0; i < kNumCubins && image.data == nullptr; ++i) {
    const unsigned char* b = kCubins[i].begin;
    const size_t n = size_t(kCubins[i].end - b);
    for (const unsigned char* p = b; p + needle.size() <= b + n;) {
      p = static_cast<const unsigned char*>(std::memchr(p, '\0', size_t(b + n - p)));
      if (p == nullptr || p + needle.size() > b + n) break;
      if (std::memcmp(p, needle.data(), needle.size()) == 0) {
        image.data = b;
        image.size = n;
        break;
      }
      ++p;
    }
  }
  if (image.data == nullptr) image.error = "no embedded cubin holds " + image.name;
  return image;
}

// JOA_FFI_RECORD_PDL=0: kernel nodes without programmatic edges (an A/B switch; read once).
bool NodesMayUsePdl() {
  static const bool pdl = [] {
    const char* v = std::getenv("JOA_FFI_RECORD_PDL");
    return v == nullptr || std::string(v) != "0";
  }();
  return pdl;
}

ffi::Error Fallback(Context& rec, const std::string& why) {
  ++g_fallbacks;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_last_fallback = why;
  }
  return rec.RequestStreamCapture();
}

}  // namespace

ffi::Error Emit(Context& rec, const LaunchRecorder& recorder) {
  const std::vector<RecordedLaunch>& launches = recorder.launches();
  if (launches.empty() || int64_t(launches.size()) > rec.commands().capacity()) {
    return Fallback(rec, "a handler recorded " + std::to_string(launches.size()) + " launches");
  }
  std::vector<const KernelImage*> images;
  for (const RecordedLaunch& l : launches) {
    if (l.needs_function_attributes) return Fallback(rec, "a launch needs a function attribute");
    images.push_back(&FindImage(l.kernel));
    if (images.back()->data == nullptr) return Fallback(rec, images.back()->error);
  }
  if (rec.action() == ffi::RecordAction::kUpdate && rec.commands().size() != int64_t(launches.size())) {
    return Fallback(rec, "update with a different number of commands");  // created as a capture
  }
  for (size_t i = 0; i < launches.size(); ++i) {
    const RecordedLaunch& l = launches[i];
    const std::vector<ffi::KernelArg> args = {ffi::HostValue{l.params, l.params_size}};
    if (rec.action() == ffi::RecordAction::kUpdate) {
      if (ffi::Error e = rec.UpdateLaunch(rec.commands()[i], args); e.failure()) return e;
      continue;
    }
    const int c = l.cluster > 1 ? int(l.cluster) : 0;
    const XLA_FFI_LaunchDims dims{{int32_t(l.grid.x), int32_t(l.grid.y), int32_t(l.grid.z)},
                                  {int32_t(l.block.x), int32_t(l.block.y), int32_t(l.block.z)},
                                  {c, c ? 1 : 0, c ? 1 : 0}};
    // Launches of one handler run in order: each after the previous (XLA adds its own
    // predecessors to every launch).
    const bool pdl = l.pdl && NodesMayUsePdl();
    auto cmd = i == 0 ? rec.CreateLaunch(images[i]->name.c_str(), images[i]->data, images[i]->size,
                                         ffi::SourceFormat::kCubin, dims, l.smem, pdl, args)
                      : rec.CreateLaunch(images[i]->name.c_str(), images[i]->data, images[i]->size,
                                         ffi::SourceFormat::kCubin, dims, l.smem, pdl, args,
                                         {rec.commands()[int64_t(i) - 1]});
    if (cmd.has_error()) return cmd.error();
  }
  ++(rec.action() == ffi::RecordAction::kUpdate ? g_updates : g_creates);
  return ffi::Error::Success();
}

namespace {
ffi::Error ProbeImpl(ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }
}  // namespace

XLA_FFI_DEFINE_HANDLER(ProbeHandler, ProbeImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

XLA_FFI_Error* ApiProbe(XLA_FFI_CallFrame* frame) {
  if (frame != nullptr && frame->api != nullptr) g_api = frame->api;
  return ProbeHandler(frame);
}

int ApiMinorVersion() {
  const XLA_FFI_Api* api = g_api;
  return api == nullptr ? -1 : api->api_version.minor_version;
}

std::string Register(const std::string& name, XLA_FFI_Handler* execute, XLA_FFI_Handler* record) {
  const XLA_FFI_Api* api = g_api;
  if (api == nullptr) return "XLA has not called the API probe (is jax's CUDA backend running?)";
  if (api->api_version.major_version != XLA_FFI_API_MAJOR || api->api_version.minor_version < XLA_FFI_API_MINOR) {
    return "the running XLA FFI API is " + std::to_string(api->api_version.major_version) + "." +
           std::to_string(api->api_version.minor_version) + ", the record stage needs " +
           std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  }
  XLA_FFI_Handler_Bundle bundle{nullptr, nullptr, nullptr, execute, record};
  XLA_FFI_Error* err = ffi::Ffi::RegisterStaticHandler(api, name, "CUDA", bundle,
                                                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
  if (err == nullptr) return "";
  const ffi::internal::ErrorDetails details = ffi::internal::GetErrorDetails(api, err);
  std::string message = details.message != nullptr && *details.message ? details.message : "registration failed";
  ffi::internal::DestroyError(api, err);
  return message;
}

Counters GetCounters() {
  Counters c;
  c.creates = g_creates;
  c.updates = g_updates;
  c.fallbacks = g_fallbacks;
  std::lock_guard<std::mutex> lock(g_mutex);
  c.last_fallback = g_last_fallback;
  return c;
}

}  // namespace joa::record

#endif  // JOA_HAVE_FFI_RECORD
