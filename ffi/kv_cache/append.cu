// In-place KV-cache append, shared by both attention operators.
//
// cache [B, H, C, D] (aliased to the output), rows [B, H, S, D], start int32 [B] -> cache, status [B].
// Batch row b's S new rows go to cache[b, :, start[b] : start[b] + S]. start is read on the device so
// the launch never depends on it (command-buffer safe). A batch row whose rows do not all fit in
// [0, C) is skipped whole (the cache keeps its old contents) and status[b] gets kKvWriteOutOfRange.
#include <cstdint>

#include "common/ffi.h"
#include "common/status.h"

namespace joa {
namespace {

// The copy is dtype-agnostic: each thread moves one Vec (up to 16 bytes) of a row.
template <typename Vec>
__global__ void KvAppendKernel(Vec* __restrict__ cache, const Vec* __restrict__ rows,
                               const int32_t* __restrict__ start, int32_t* __restrict__ status,
                               int heads, int capacity, int new_rows, int row_vecs) {
  const int b = blockIdx.y;
  const int pos = start[b];
  const bool fits = pos >= 0 && pos <= capacity - new_rows;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    status[b] = fits ? status::kOk : status::kKvWriteOutOfRange;
  }
  if (!fits) return;
  const int64_t per_batch = int64_t(heads) * new_rows * row_vecs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < per_batch;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int v = int(i % row_vecs);
    const int64_t r = i / row_vecs;  // r = h * S + s
    const int s = int(r % new_rows);
    const int64_t h = r / new_rows;
    const int64_t src = (int64_t(b) * heads * new_rows + r) * row_vecs + v;
    const int64_t dst = ((int64_t(b) * heads + h) * capacity + pos + s) * row_vecs + v;
    cache[dst] = rows[src];
  }
}

template <typename Vec>
void Launch(cudaStream_t stream, void* cache, const void* rows, const int32_t* start,
            int32_t* status, int64_t batch, int64_t heads, int64_t capacity, int64_t new_rows,
            int64_t row_bytes) {
  constexpr int kThreads = 256;
  const int64_t row_vecs = row_bytes / int64_t(sizeof(Vec));
  const int64_t per_batch = heads * new_rows * row_vecs;
  // Enough blocks to cover a batch row, capped: a grid-stride loop does the rest.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((per_batch + kThreads - 1) / kThreads, 1024));
  KvAppendKernel<Vec><<<dim3(unsigned(blocks), unsigned(batch)), kThreads, 0, stream>>>(
      static_cast<Vec*>(cache), static_cast<const Vec*>(rows), start, status, int(heads),
      int(capacity), int(new_rows), int(row_vecs));
}

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
    Launch<uint4>(stream, dst, src, pos, flags, batch, heads, capacity, new_rows, row_bytes);
  } else if (row_bytes % 8 == 0) {
    Launch<uint2>(stream, dst, src, pos, flags, batch, heads, capacity, new_rows, row_bytes);
  } else if (row_bytes % 4 == 0) {
    Launch<uint32_t>(stream, dst, src, pos, flags, batch, heads, capacity, new_rows, row_bytes);
  } else {
    Launch<uint16_t>(stream, dst, src, pos, flags, batch, heads, capacity, new_rows, row_bytes);
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
