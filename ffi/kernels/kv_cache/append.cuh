// The in-place KV-cache append kernel (handler: ffi/handlers/kv_append.cu).
//
// cache [B, H, C, D], rows [B, H, S, D], start int32 [B]: batch row b's S new rows go to
// cache[b, :, start[b] : start[b] + S]; a batch row whose rows do not all fit in [0, C) is skipped
// whole and status[b] gets kKvWriteOutOfRange. start is read on the device.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/status.h"

namespace joa::kv_cache {
// Internal linkage, as when the kernel lived in its handler's file: one TU (the handler) includes this.
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

}  // namespace
}  // namespace joa::kv_cache
