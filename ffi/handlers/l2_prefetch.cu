// l2_prefetch: x -> x (aliased, untouched), and the first `max_bytes` of the other operands'
// concatenation requested into L2 (kernels/prefetch/l2.cuh). The lowering places it where HBM is
// about to idle (before a decode step's attention) with the weights of the GEMV that comes after;
// x gives the call its place in the step (it reads the previous kernel's output and the next one
// reads it). Only pointers and sizes are read on the host: command-buffer safe.
#include <algorithm>
#include <cstdint>
#include <string>

#include "common/ffi.h"
#include "kernels/prefetch/l2.cuh"

namespace joa {
namespace {

ffi::Error L2PrefetchImpl(cudaStream_t stream, AnyBuffer x, ffi::RemainingArgs buffers, AnyResult x_out,
                          int64_t max_bytes, int64_t mode, int64_t ctas) {
  auto fail = [](const std::string& what) { return InvalidArgument("l2_prefetch: " + what); };
  if (x_out->untyped_data() != x.untyped_data()) return fail("x must be aliased to the result");
  if (buffers.size() > size_t(prefetch::kMaxBuffers)) {
    return fail("at most " + std::to_string(prefetch::kMaxBuffers) + " buffers, got " + std::to_string(buffers.size()));
  }
  if (mode < 0 || mode >= prefetch::kModes) return fail("mode must be in [0, 3), got " + std::to_string(mode));
  if (ctas < 1 || ctas > 4096) return fail("ctas must be in [1, 4096], got " + std::to_string(ctas));
  prefetch::Params p{};
  int64_t left = std::max<int64_t>(max_bytes, 0);
  for (size_t i = 0; i < buffers.size() && left > 0; ++i) {
    auto b = buffers.get<AnyBuffer>(i);
    if (!b.has_error()) {
      const int64_t n = std::min<int64_t>(int64_t(b.value().size_bytes()), left) / 16 * 16;
      if (n == 0) continue;
      p.ptr[p.count] = static_cast<const unsigned char*>(b.value().untyped_data());
      p.bytes[p.count++] = n;
      p.total += n;
      left -= n;
    } else {
      return fail("operand " + std::to_string(i + 1) + " is not a buffer");
    }
  }
  if (p.total == 0) return ffi::Error::Success();
  const int64_t grid = std::min<int64_t>(ctas, (p.total + 4095) / 4096);
  p.per_cta = ((p.total + grid - 1) / grid + 15) / 16 * 16;
  const unsigned blocks = unsigned((p.total + p.per_cta - 1) / p.per_cta);
  switch (prefetch::Mode(mode)) {
    case prefetch::Mode::kBulk:
      prefetch::L2PrefetchKernel<prefetch::Mode::kBulk><<<blocks, prefetch::kThreads, 0, stream>>>(p);
      break;
    case prefetch::Mode::kBulkEvictLast:
      prefetch::L2PrefetchKernel<prefetch::Mode::kBulkEvictLast><<<blocks, prefetch::kThreads, 0, stream>>>(p);
      break;
    case prefetch::Mode::kLines:
      prefetch::L2PrefetchKernel<prefetch::Mode::kLines><<<blocks, prefetch::kThreads, 0, stream>>>(p);
      break;
  }
  return LaunchStatus("l2_prefetch");
}

}  // namespace
}  // namespace joa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaL2Prefetch, joa::L2PrefetchImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<joa::Stream>()
                                  .Arg<joa::AnyBuffer>()  // x (aliased to the result)
                                  .RemainingArgs()        // the buffers to prefetch, in order
                                  .Ret<joa::AnyBuffer>()  // x
                                  .Attr<int64_t>("max_bytes")
                                  .Attr<int64_t>("mode")
                                  .Attr<int64_t>("ctas"),
                              JOA_COMMAND_BUFFER_SAFE);
