// kv_append: the in-place KV-cache append, shared by both attention operators (kernel:
// kernels/kv_cache/append.cuh).
//
// cache [B, H, C, D] (aliased to the output), rows [B, H, S, D], start int32 [B] -> cache, status [B].
// Batch row b's S new rows go to cache[b, :, start[b] : start[b] + S]. start is read on the device so
// the launch never depends on it (command-buffer safe). A batch row whose rows do not all fit in
// [0, C) is skipped whole (the cache keeps its old contents) and status[b] gets kKvWriteOutOfRange.
#include <cstdint>

#include "common/ffi.h"
#include "kernels/kv_cache/append.cuh"

namespace joa {
namespace {

ffi::Error KvAppendImpl(cudaStream_t stream, AnyBuffer cache, AnyBuffer rows, Int32Buffer start,
                        AnyResult cache_out, Int32Result status) {
  auto cd = cache.dimensions();
  auto rd = rows.dimensions();
  if (cd.size() != 4 || rd.size() != 4) return InvalidArgument("kv_append: cache and rows must be rank 4");
  if (cache.element_type() != rows.element_type()) return InvalidArgument("kv_append: cache and rows differ in dtype");
  if (cd[0] != rd[0] || cd[1] != rd[1] || cd[3] != rd[3] || rd[2] > cd[2]) {
    return InvalidArgument("kv_append: rows [B, H, S, D] do not fit cache [B, H, C, D]");
  }
  if (start.dimensions().size() != 1 || start.dimensions()[0] != cd[0]) {
    return InvalidArgument("kv_append: start must be int32 [B]");
  }
  const int64_t batch = cd[0], heads = cd[1], capacity = cd[2], new_rows = rd[2];
  if (batch == 0) return ffi::Error::Success();
  const int64_t row_bytes = cd[3] * int64_t(ffi::ByteWidth(cache.element_type()));
  void* dst = cache_out->untyped_data();
  const void* src = rows.untyped_data();
  const int32_t* pos = start.typed_data();
  int32_t* flags = status->typed_data();
  // Widest vector that divides a row: 16-byte loads and stores for every usual head size.
  if (row_bytes % 16 == 0) {
    kv_cache::Launch<uint4>(stream, dst, src, pos, flags, batch, heads, capacity, new_rows, row_bytes);
  } else if (row_bytes % 8 == 0) {
    kv_cache::Launch<uint2>(stream, dst, src, pos, flags, batch, heads, capacity, new_rows, row_bytes);
  } else if (row_bytes % 4 == 0) {
    kv_cache::Launch<uint32_t>(stream, dst, src, pos, flags, batch, heads, capacity, new_rows, row_bytes);
  } else {
    kv_cache::Launch<uint16_t>(stream, dst, src, pos, flags, batch, heads, capacity, new_rows, row_bytes);
  }
  return LaunchStatus("kv_append");
}

}  // namespace
}  // namespace joa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaKvAppend, joa::KvAppendImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<joa::Stream>()
                                  .Arg<joa::AnyBuffer>()    // cache (aliased to result 0)
                                  .Arg<joa::AnyBuffer>()    // rows
                                  .Arg<joa::Int32Buffer>()  // start
                                  .Ret<joa::AnyBuffer>()    // cache
                                  .Ret<joa::Int32Buffer>(), // status
                              JOA_COMMAND_BUFFER_SAFE);
