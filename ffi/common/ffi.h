// Shared XLA FFI aliases and helpers for every handler in ffi/ (one place, like TransformerEngine's
// csrc/extensions/ffi.h). Handlers are command-buffer compatible: no host synchronisation, no
// device-to-host reads, no allocation; launch geometry depends only on static shapes and attributes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

// Traits of every handler: XLA may capture it into a command buffer (CUDA graph). A macro because
// XLA_FFI_DEFINE_HANDLER_SYMBOL takes the traits as a braced list.
#define JOA_COMMAND_BUFFER_SAFE {xla::ffi::Traits::kCmdBufferCompatible}

namespace joa {

namespace ffi = xla::ffi;

using Stream = ffi::PlatformStream<cudaStream_t>;
using AnyBuffer = ffi::AnyBuffer;
using Int32Buffer = ffi::Buffer<ffi::S32>;
using AnyResult = ffi::Result<ffi::AnyBuffer>;
using Int32Result = ffi::Result<ffi::Buffer<ffi::S32>>;


// Turns a failed launch into an FFI error (reported as jax.errors.JaxRuntimeError).
inline ffi::Error LaunchStatus(const char* kernel) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(kernel) + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

inline ffi::Error InvalidArgument(const std::string& what) {
  return ffi::Error::InvalidArgument(what);
}

// Whether a buffer (any FFI buffer or result) has exactly these dimensions.
template <class Buffer>
bool HasShape(const Buffer& x, std::initializer_list<int64_t> shape) {
  auto dims = x.dimensions();
  if (dims.size() != shape.size()) return false;
  size_t i = 0;
  for (int64_t n : shape) {
    if (dims[i++] != n) return false;
  }
  return true;
}

// Calls f(T{}) with T the CUDA type of a float element type (f32, f16, bf16).
template <typename F>
ffi::Error DispatchFloat(ffi::DataType dtype, const char* op, F&& f) {
  switch (dtype) {
    case ffi::DataType::F32: return f(float{});
    case ffi::DataType::F16: return f(__half{});
    case ffi::DataType::BF16: return f(__nv_bfloat16{});
    default: return InvalidArgument(std::string(op) + ": unsupported element type (f32, f16, bf16 only)");
  }
}

}  // namespace joa
