// Session 31's open question (bench/results/2026-12-01-e2e-notes.md, "Session 31"): the decode engine's
// launches run 10-15% slower in XLA's command buffer than in a raw CUDA graph. This library, loaded
// by tools/probes/decode_raw_on_jax.py into a jax process, times the engine's one-split B=1 launch
// (bf16 32/8 d128, as tools/probes/decode_last_cta.cu `one-split`) as a raw CUDA graph of 64 calls
// on buffers it is given: jax arrays' device pointers, or copies it allocates itself with cudaMalloc.
// Same process, same kernel, same graph: if jax's buffers are slower, it is their placement; if not,
// it is what XLA does around the launch.
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -shared -Xcompiler -fPIC -I ffi \
//        -I <build>/generated -I <build>/xla_ffi_include -I tools/probes \
//        tools/probes/decode_raw_on_jax.cu -o decode_raw_on_jax.so
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "decode_b1_params.h"
#include "graph_chain.h"
#include "kernels/decode/launch.cuh"

using namespace joa;
using namespace joa::decode;
using T = __nv_bfloat16;
constexpr int kD = 128, kHq = 32, kHkv = 8, kCalls = 64;

// Times kCalls one-split calls over `copies` K / V buffers read in turn (call i: copy i % copies),
// q [1, 32, 1, 128], out like q, lens int32 [1] on the device, the cache `ctx` rows. Returns a
// cudaError_t; *us gets the time a call (best of 5 x 20 replays).
extern "C" int joa_time_one_split(const void* q, const void* const* ks, const void* const* vs, int copies,
                                  const int32_t* lens, void* out, int ctx, float* us) {
  DecodeParams p = B1DecodeParams(ctx, (ctx + 63) / 64 * 64, kHq, kHkv, kD);  // one split
  p.q = q; p.out = out; p.kv_len = lens;
  const LaunchOptions opt{false, true, false, true, false, false, false};
  cudaStream_t s;
  cudaError_t err = cudaStreamCreate(&s);
  if (err != cudaSuccess) return int(err);
  auto launch = [&](int i, cudaStream_t st) {
    DecodeParams pi = p;
    pi.k = ks[i % copies];
    pi.v = vs[i % copies];
    return joa::decode::Launch<T, kD, KvFormat::kDense>(pi, opt, st);
  };
  err = TimeGraphChain(kCalls, launch, false, s, 20, 5, us);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  return int(err);
}

// The same graph of kCalls one-split calls replayed `replays` times, untimed (for a profiler to see
// the kernels: tools/probes/decode_gap_timeline.py). Returns a cudaError_t.
extern "C" int joa_replay_one_split(const void* q, const void* const* ks, const void* const* vs, int copies,
                                    const int32_t* lens, void* out, int ctx, int replays) {
  DecodeParams p = B1DecodeParams(ctx, (ctx + 63) / 64 * 64, kHq, kHkv, kD);
  p.q = q; p.out = out; p.kv_len = lens;
  const LaunchOptions opt{false, true, false, true, false, false, false};
  cudaStream_t s;
  cudaError_t err = cudaStreamCreate(&s);
  if (err != cudaSuccess) return int(err);
  cudaGraph_t g = nullptr;
  cudaGraphExec_t exec = nullptr;
  err = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  for (int i = 0; i < kCalls && err == cudaSuccess; ++i) {
    DecodeParams pi = p;
    pi.k = ks[i % copies];
    pi.v = vs[i % copies];
    err = joa::decode::Launch<T, kD, KvFormat::kDense>(pi, opt, s);
  }
  cudaError_t end = cudaStreamEndCapture(s, &g);
  if (err == cudaSuccess) err = end;
  if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, g, 0);
  for (int r = 0; r < replays && err == cudaSuccess; ++r) err = cudaGraphLaunch(exec, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (exec) cudaGraphExecDestroy(exec);
  if (g) cudaGraphDestroy(g);
  cudaStreamDestroy(s);
  return int(err);
}

// cudaMalloc / cudaFree for the script's own copies (so that both sets live in the same process).
extern "C" int joa_malloc(void** p, size_t bytes) { return int(cudaMalloc(p, bytes)); }
extern "C" int joa_memcpy_d2d(void* dst, const void* src, size_t bytes) {
  return int(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
}
extern "C" int joa_free(void* p) { return int(cudaFree(p)); }
