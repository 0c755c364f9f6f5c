// Session 31: what the B=1 decode call would gain if the last split CTA of a (b, KV head, M block)
// merged the splits itself instead of the combine kernel (issue 15's "combine overlapped with the
// last tiles"). The engine's own split body (DecodeSplitBody, bf16 d128, 1 x 4 warps, cursor loads,
// MaskVariant) and merge (MergeSplitRow), 32/8 B=1 q_len 1 at the planner's B=1 splits (256 rows to
// 4096, 512 at 8192), timed as a CUDA graph of L dependent calls (tools/probes/graph_chain.h):
//   a) the engine's path: split kernel + the combine kernel as a programmatic dependent (today);
//   b) last CTA: a wrapper kernel runs the split body, then each CTA's thread 0 fences and bumps a
//      per-block counter; the CTA that brings it to `splits` fences, merges the block's rows from
//      the workspace (L2 loads) and resets the counter (zero once, at allocation: persistent);
//   c) as b with the counters zeroed by a memset node before each call (no persistent state).
// Also checks that b's output equals a's bit for bit, and times a as child graphs (how XLA records
// an FFI call) and without the PDL edge. `./decode_last_cta one-split`: one split a call (one launch,
// a only); `one-split+N`: with the K / V copies N bytes past cudaMalloc's alignment.
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I ffi -I <build>/generated \
//        -I <build>/xla_ffi_include -I tools/probes tools/probes/decode_last_cta.cu -o decode_last_cta
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "decode_b1_params.h"
#include "graph_chain.h"
#include "probe_util.h"  // CK
#include "kernels/decode/launch.cuh"

using namespace joa;
using namespace joa::decode;
using T = __nv_bfloat16;
constexpr int kD = 128;
using Kv = DenseCursorKv<T>;
using Cfg = EngineConfig<T, kD, 1, 4, Kv>;
constexpr int kMergeSplits = 16;  // the probe's plans have at most 16 splits

__device__ __forceinline__ float4 LoadL2f4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

__global__ void __launch_bounds__(Cfg::kLaunchThreads, Cfg::kCtasPerSm)
    SplitLastCta(const __grid_constant__ DecodeParams p, unsigned* counters) {
  DecodeSplitBody<T, kD, 1, 4, MaskVariant, Kv>(p);
  __shared__ int s_last;
  const int block = blockIdx.z * gridDim.y + blockIdx.y;
  __syncthreads();  // every thread's partial stores issued
  if (threadIdx.x == 0) {
    __threadfence();  // ... and visible before the counter moves
    s_last = atomicAdd(counters + block, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const int kvh = blockIdx.y / p.m_blocks, mb = blockIdx.y % p.m_blocks, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t bh = int64_t(b) * p.kv_heads + kvh;
  for (int R = mb * Cfg::kBlockM + warp; R < min(p.rows, (mb + 1) * Cfg::kBlockM); R += Cfg::kWarps) {
    const int h = kvh * p.group + R / p.q_len, i = R % p.q_len;
    const int64_t first = bh * p.splits * p.rows + R;
    // MergeFewSplitsRow's math (splits <= 32) with its loads through L2 (other CTAs wrote them).
    const int d0 = lane * 4;
    // Every load of the row at once (one L2 round trip), as MergeFewSplitsRow's kUnroll does.
    const float lse = lane < p.splits ? __ldcg(p.part_lse + first + int64_t(lane) * p.rows) : -INFINITY;
    float4 xs[kMergeSplits];
#pragma unroll
    for (int s = 0; s < kMergeSplits; ++s) {
      xs[s] = s < p.splits ? LoadL2f4(p.part_o + (first + int64_t(s) * p.rows) * kD + d0) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float mx = lse;
    for (int off = 16; off > 0; off >>= 1) mx = ptx::MaxNan(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    mx = ptx::MaxNan(mx, SinkLog2(p.variant.sink, h));
    T* out = static_cast<T*>(p.out) + b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_s;
    if (mx == -INFINITY) {
      StoreVec4(out + d0, make_float4(0.f, 0.f, 0.f, 0.f));
      continue;
    }
    const float w_lane = lane < p.splits ? ptx::Exp2(lse - mx) : 0.f;
    float sum = w_lane;
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float inv = sum == 0.f ? 0.f : 1.f / sum;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < kMergeSplits; ++s) {
      const float w = __shfl_sync(0xffffffffu, w_lane, s);
      float4 x = s < p.splits ? xs[s] : make_float4(0.f, 0.f, 0.f, 0.f);
      if (w == 0.f) x = make_float4(0.f, 0.f, 0.f, 0.f);
      acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w;
    }
    StoreVec4(out + d0, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
  }
  if (threadIdx.x == 0) counters[block] = 0;  // the next call starts from zero
}

__global__ void FillBf16(T* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16(float(int(h & 0xFFFF) - 32768) / 16384.f);
  }
}

int main(int argc, char** argv) {
  // "one-split": every call one split (split_rows = the capacity): the engine's path is one launch.
  const bool one_split = argc > 1 && std::string(argv[1]).rfind("one-split", 0) == 0;
  // "one-split+N": the K / V copies start N bytes past cudaMalloc's alignment (as an arena might place them).
  const size_t shift = argc > 1 && std::string(argv[1]).size() > 10 ? size_t(std::stoi(std::string(argv[1]).substr(10))) : 0;
  const int hq = 32, hkv = 8, L = 64, kCopies = 16;
  // PERSIST_MB=N: set aside N MB of L2 for persisting accesses first (as a jax process may have it).
  if (const char* mb = std::getenv("PERSIST_MB")) {
    CK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, size_t(std::atof(mb) * (1 << 20))));
    size_t got = 0;
    CK(cudaDeviceGetLimit(&got, cudaLimitPersistingL2CacheSize));
    printf("persisting L2 set-aside: %.1f MB\n", got / 1048576.0);
  }
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  printf("ctx splits split_rows | engine(split+combine PDL) us | last-CTA us | last-CTA+memset us | same bits\n");
  for (int ctx : {2304, 4096, 8192}) {
    const int split_rows = one_split ? (ctx + 63) / 64 * 64 : ctx <= 4096 ? 256 : 512;
    DecodeParams p = B1DecodeParams(ctx, split_rows, hq, hkv, kD);
    T *q, *k, *v, *out_a, *out_b;
    float* ws;
    int32_t* lens;
    unsigned* counters;
    const size_t kv_elems = size_t(hkv) * ctx * kD;
    CK(cudaMalloc(&q, hq * kD * sizeof(T)));
    // kCopies K / V copies read in turn (call i reads copy i % kCopies), so that calls miss the L2
    // as bench decode's rotations make them.
    CK(cudaMalloc(&k, kCopies * kv_elems * sizeof(T) + 4096));
    CK(cudaMalloc(&v, kCopies * kv_elems * sizeof(T) + 4096));
    T* k_alloc = k;
    T* v_alloc = v;
    k = reinterpret_cast<T*>(reinterpret_cast<char*>(k) + shift);
    v = reinterpret_cast<T*>(reinterpret_cast<char*>(v) + shift);
    CK(cudaMalloc(&out_a, hq * kD * sizeof(T)));
    CK(cudaMalloc(&out_b, hq * kD * sizeof(T)));
    CK(cudaMalloc(&ws, WorkspaceElems(1, hkv, p.splits, p.rows, kD) * sizeof(float)));
    CK(cudaMalloc(&lens, sizeof(int32_t)));
    CK(cudaMalloc(&counters, 4096 * sizeof(unsigned)));
    CK(cudaMemset(counters, 0, 4096 * sizeof(unsigned)));
    FillBf16<<<264, 256>>>(q, hq * kD, 1);
    FillBf16<<<264, 256>>>(k, kCopies * kv_elems, 2);
    FillBf16<<<264, 256>>>(v, kCopies * kv_elems, 3);
    CK(cudaMemcpy(lens, &ctx, sizeof(int32_t), cudaMemcpyHostToDevice));
    p.q = q; p.k = k; p.v = v; p.kv_len = lens;
    p.part_o = ws;
    p.part_lse = ws + int64_t(hkv) * p.splits * p.rows * kD;
    p.m_blocks = (p.rows + Cfg::kBlockM - 1) / Cfg::kBlockM;
    const LaunchOptions opt{false, true, false, true, false, false, false};
    CK(cudaFuncSetAttribute(SplitLastCta, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
    CK(cudaFuncSetAttribute(SplitLastCta, cudaFuncAttributePreferredSharedMemoryCarveout,
                            int(cudaSharedmemCarveoutMaxShared)));
    const dim3 grid(unsigned(p.splits), unsigned(p.kv_heads * p.m_blocks), 1u);
    auto engine = [&](int i, cudaStream_t st) {
      DecodeParams pa = p;
      pa.k = k + (i % kCopies) * kv_elems;
      pa.v = v + (i % kCopies) * kv_elems;
      pa.out = out_a;
      return joa::decode::Launch<T, kD, KvFormat::kDense>(pa, opt, st);
    };
    auto last_cta = [&](int i, cudaStream_t st) {
      DecodeParams pb = p;
      pb.k = k + (i % kCopies) * kv_elems;
      pb.v = v + (i % kCopies) * kv_elems;
      pb.out = out_b;
      SplitLastCta<<<grid, Cfg::kLaunchThreads, Cfg::kSmemBytes, st>>>(pb, counters);
      return cudaGetLastError();
    };
    auto last_cta_memset = [&](int i, cudaStream_t st) {
      cudaError_t e = cudaMemsetAsync(counters, 0, 64 * sizeof(unsigned), st);
      return e != cudaSuccess ? e : last_cta(i, st);
    };
    auto engine_no_pdl = [&](int i, cudaStream_t st) {
      DecodeParams pa = p;
      pa.k = k + (i % kCopies) * kv_elems;
      pa.v = v + (i % kCopies) * kv_elems;
      pa.out = out_a;
      LaunchOptions o = opt;
      o.pdl = false;
      return joa::decode::Launch<T, kD, KvFormat::kDense>(pa, o, st);
    };
    float us_a = 0, us_b = 0, us_c = 0, us_child = 0, us_nopdl = 0, us_child_nopdl = 0;
    // How XLA records an FFI call: each call's launches captured as a child graph.
    CK(TimeGraphChain(L, engine, true, s, 20, 5, &us_child));
    CK(TimeGraphChain(L, engine_no_pdl, false, s, 20, 5, &us_nopdl));
    CK(TimeGraphChain(L, engine_no_pdl, true, s, 20, 5, &us_child_nopdl));
    printf("  engine as child graphs (XLA's recording) %.2f us; without PDL: kernel nodes %.2f, child graphs %.2f\n",
           us_child, us_nopdl, us_child_nopdl);
    CK(TimeGraphChain(L, engine, false, s, 20, 5, &us_a));
    if (one_split) {  // one launch a call: no merge to compare
      printf("%d %d %d | %.2f (one split, K / V shifted %zu bytes)\n", ctx, p.splits, split_rows, us_a, shift);
      continue;  // (the buffers of this shape are left to the process's end)
    }
    CK(TimeGraphChain(L, last_cta, false, s, 20, 5, &us_b));
    CK(TimeGraphChain(L, last_cta_memset, false, s, 20, 5, &us_c));
    CK(cudaStreamSynchronize(s));
    std::vector<uint16_t> a(hq * kD), b(hq * kD);
    CK(cudaMemcpy(a.data(), out_a, a.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), out_b, b.size() * 2, cudaMemcpyDeviceToHost));
    int diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff += a[i] != b[i];
    printf("%d %d %d | %.2f | %.2f | %.2f | %s (%d of %zu differ)\n", ctx, p.splits, split_rows, us_a, us_b, us_c,
           diff ? "NO" : "yes", diff, a.size());
    cudaFree(q); cudaFree(k_alloc); cudaFree(v_alloc); cudaFree(out_a); cudaFree(out_b); cudaFree(ws); cudaFree(lens);
    cudaFree(counters);
  }
  return 0;
}
