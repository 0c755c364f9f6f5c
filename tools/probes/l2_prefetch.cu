// Probe: can the kernels of a batch-1 decode layer buy back their ramp and drain by asking the L2
// for the next kernel's weight early? A layer is qkv -> attention -> o -> gate-up -> down: the
// dense row GEMVs, and for the attention a stand-in (C CTAs, R dependent rounds of 16 KB each:
// its time is latency, not bytes, ~0.3 TB/s as the real one at batch 1). Each launch its own child
// graph as XLA records FFI calls; L layers on distinct weights (past the L2). Prefetches:
//   stand-in: its CTAs ask for o's weight (+ gate-up's head) after their first loads; bulk (one
//     thread, cp.async.bulk.prefetch.L2 in 64 KB pieces) or lane (prefetch.global.L2 a line);
//   tail (GemvParams::l2_next): each GEMV CTA past its last tile asks for its share of the next
//     GEMV's weight head (qkv's for all of o: it lands under the attention).
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -diag-suppress=940,2473,128 -I ffi -I tools/probes tools/probes/l2_prefetch.cu \
//     ffi/kernels/gemv/inst/gemv_f16_dense.cu -o l2_prefetch
// Env: JOA_PROBE_8B=1 adds the ~8B shapes (2: only them).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "graph_chain.h"
#include "kernels/gemv/gemv.h"
#include "kernels/gemv/plan.h"
#include "one_row.h"
#include "probe_util.h"

using namespace joa::gemv;

// The prefetch a stand-in CTA issues: its 1/gridDim.x slice of [pf, pf + pf_bytes).
struct Prefetch {
  const uint8_t* p = nullptr;
  size_t bytes = 0;
  int kind = 0;  // 0 none, 1 bulk, 2 lane
};

__device__ __forceinline__ void IssuePrefetch(const Prefetch& pf) {
  if (pf.kind == 0 || pf.bytes == 0) return;
  const size_t slice = (pf.bytes / gridDim.x + 127) & ~size_t(127);
  const size_t lo = slice * blockIdx.x, hi = std::min(pf.bytes, lo + slice);
  if (lo >= hi) return;
  if (pf.kind == 1) {
    if (threadIdx.x == 0) {
      for (size_t o = lo; o < hi; o += 65536) {
        const uint32_t n = uint32_t(std::min<size_t>(65536, hi - o));
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(pf.p + o), "r"(n) : "memory");
      }
    }
  } else {
    for (size_t o = lo + 128 * threadIdx.x; o < hi; o += 128 * blockDim.x) {
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(pf.p + o));
    }
  }
}

// R rounds; in round r every thread reads 8 x 16 bytes at an offset that depends on round r-1's
// data (so the rounds are dependent memory round trips, as the attention's tile chain is).
__global__ void __launch_bounds__(128) StandIn(const uint4* kv, size_t kv16, int rounds, Prefetch pf,
                                                Prefetch pf2, uint32_t* sink) {
  uint32_t acc = 0;
  size_t base = size_t(blockIdx.x) * rounds * 1024;
  for (int r = 0; r < rounds; ++r) {
    const size_t at = (base + size_t(r) * 1024 + threadIdx.x + (acc == 0x9e3779b9u ? 1 : 0)) % kv16;
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __ldcs(kv + (at + 128 * j) % kv16);
    if (r == 0) {  // after the first round's loads are out
      IssuePrefetch(pf);
      IssuePrefetch(pf2);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) acc += v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    __syncthreads();
  }
  if (acc == 0x12345678u) *sink = acc;
}

struct Model {
  const char* name;
  int h, inter, qkv_rows, ctas, rounds;
};

int main() {
  ProbeEnv env;
  CK(MakeProbeEnv(env));
  cudaStream_t s = env.stream;
  const int with_8b = getenv("JOA_PROBE_8B") ? atoi(getenv("JOA_PROBE_8B")) : 0;
  // Stand-in geometry: 64 CTAs; rounds picked so the stand-in alone takes about what the decode
  // attention takes in the step (~1B ctx 1k ~6.7 µs, ~8B ctx 2k ~12 µs on the H100).
  const Model models[] = {{"1b", 2048, 8192, 3072, 64, 6}, {"8b", 4096, 14336, 6144, 64, 12}};
  for (const Model& m : models) {
    const bool is_8b = m.h == 4096;
    if (is_8b ? with_8b == 0 : with_8b == 2) continue;
    const int H = m.h, I = m.inter, Q = m.qkv_rows;
    const size_t q_bytes = size_t(Q) * H * 2, o_bytes = size_t(H) * H * 2, gu_bytes = size_t(2) * I * H * 2,
                 dn_bytes = size_t(H) * I * 2;
    const size_t kv_bytes = size_t(m.ctas) * m.rounds * 16384;
    const size_t layer = q_bytes + o_bytes + gu_bytes + dn_bytes + kv_bytes;
    const int L = std::max<int>(2, int((size_t(600) << 20) / layer) + 1);
    __half *x, *gamma, *res;
    CK(cudaMalloc(&x, std::max(H, I) * 2));
    CK(cudaMalloc(&gamma, H * 2));
    CK(cudaMalloc(&res, H * 2));
    FillHalf<<<64, 256>>>(x, std::max(H, I), 1, -1.f, 1.f);
    FillHalf<<<64, 256>>>(gamma, H, 2, 0.5f, 1.5f);
    FillHalf<<<64, 256>>>(res, H, 3, -1.f, 1.f);
    std::vector<__half*> qw(L), ow(L), gu(L), dn(L), yq(L), hbuf(L), yo(L), y2(L);
    std::vector<uint4*> kv(L);
    std::vector<GemvParams> pq(L), po(L), pg(L), pd(L);
    const Plan plan_q = MakePlan(1, Q, H, 16, false, true, true, 0, 0, false, 0, true);
    const Plan plan_o = MakePlan(1, H, H, 16, false, false, true, 0, 0, false, 0, true);
    const Plan plan_gu = MakePlan(1, 2 * I, H, 16, true, true, true, 0, 0, false, 0, true);
    const Plan plan_dn = MakePlan(1, H, I, 16, false, false, true, 0, 0, false, 0, true);
    if (!plan_q.dense_row || !plan_o.dense_row || !plan_gu.dense_row || !plan_dn.dense_row) {
      printf("%s: no dense row plan\n", m.name);
      continue;
    }
    for (int i = 0; i < L; ++i) {
      CK(cudaMalloc(&qw[i], q_bytes));
      CK(cudaMalloc(&ow[i], o_bytes));
      CK(cudaMalloc(&gu[i], gu_bytes));
      CK(cudaMalloc(&dn[i], dn_bytes));
      CK(cudaMalloc(&kv[i], kv_bytes));
      FillHalf<<<1024, 256>>>(qw[i], q_bytes / 2, 70 + i, -0.05f, 0.05f);
      FillHalf<<<1024, 256>>>(ow[i], o_bytes / 2, 50 + i, -0.05f, 0.05f);
      FillHalf<<<1024, 256>>>(gu[i], gu_bytes / 2, 10 + i, -0.05f, 0.05f);
      FillHalf<<<1024, 256>>>(dn[i], dn_bytes / 2, 100 + i, -0.05f, 0.05f);
      CK(cudaMemset(kv[i], 1, kv_bytes));
      CK(cudaMalloc(&yq[i], Q * 2));
      CK(cudaMalloc(&hbuf[i], I * 2));
      CK(cudaMalloc(&yo[i], H * 2));
      CK(cudaMalloc(&y2[i], H * 2));
      pq[i] = OneRowParams(x, qw[i], nullptr, nullptr, gamma, yq[i], H, Q, false);
      po[i] = OneRowParams(x, ow[i], nullptr, nullptr, nullptr, yo[i], H, H, false);
      po[i].residual = res;
      pg[i] = OneRowParams(yo[i], gu[i], nullptr, nullptr, gamma, hbuf[i], H, 2 * I, true);
      pd[i] = OneRowParams(hbuf[i], dn[i], nullptr, nullptr, nullptr, y2[i], I, H, false);
      pd[i].residual = yo[i];
      for (GemvParams* p : {&pq[i], &po[i], &pg[i], &pd[i]}) p->k_blocks = p->block_shift = 0;
    }
    CK(cudaDeviceSynchronize());
    auto time = [&](int n, auto&& launch, float* us) { return TimeGraphChain(n, launch, true, s, 30, 3, us); };
    auto u8 = [](const void* p) { return static_cast<const uint8_t*>(p); };
    printf("%s: H %d I %d, L %d layers; qkv %.1f MB, o %.1f, gate-up %.1f, down %.1f; stand-in %d CTAs x %d rounds (%.1f MB)\n",
           m.name, H, I, L, q_bytes * 1e-6, o_bytes * 1e-6, gu_bytes * 1e-6, dn_bytes * 1e-6, m.ctas, m.rounds,
           kv_bytes * 1e-6);
    // Alone: the stand-in without / with the o prefetch (its latency under the extra traffic).
    float t;
    for (int kind = 0; kind <= 2; ++kind) {
      CK(time(L, [&](int i, cudaStream_t st) {
        StandIn<<<m.ctas, 128, 0, st>>>(kv[i], kv_bytes / 16, m.rounds, Prefetch{u8(ow[i]), o_bytes, kind}, Prefetch{},
                                        env.sink);
        return cudaGetLastError();
      }, &t));
      printf("  stand-in alone, o prefetch %s: %7.2f us\n", kind == 0 ? "none" : kind == 1 ? "bulk" : "lane", t);
    }
    // The layer. stand_pf: the stand-in's prefetch (0 none, 1 o + 4 MB of gate-up, bulk);
    // q_tail: qkv's CTAs ask for all of o; tail: o -> gate-up head, gate-up -> down head,
    // down -> the next layer's qkv head, `tail` bytes each.
    auto layer_time = [&](int stand_pf, bool q_tail, size_t tail) {
      for (int l = 0; l < L; ++l) {
        pq[l].l2_next = ow[l];
        pq[l].l2_next_bytes = q_tail ? int64_t(o_bytes) : 0;
        po[l].l2_next = gu[l];
        po[l].l2_next_bytes = int64_t(tail);
        pg[l].l2_next = dn[l];
        pg[l].l2_next_bytes = int64_t(tail);
        pd[l].l2_next = qw[(l + 1) % L];
        pd[l].l2_next_bytes = int64_t(std::min(tail, q_bytes));
      }
      float us = 0.f;
      CK(time(5 * L, [&](int i, cudaStream_t st) {
        const int l = i / 5;
        switch (i % 5) {
          case 0: return LaunchFormat<__half, 16, false>(pq[l], plan_q, Fusion{false, true}, false, st);
          case 1:
            StandIn<<<m.ctas, 128, 0, st>>>(kv[l], kv_bytes / 16, m.rounds, Prefetch{u8(ow[l]), stand_pf ? o_bytes : 0, 1},
                                            Prefetch{u8(gu[l]), stand_pf ? size_t(4) << 20 : 0, 1}, env.sink);
            return cudaGetLastError();
          case 2: return LaunchFormat<__half, 16, false>(po[l], plan_o, Fusion{false, false}, false, st);
          case 3: return LaunchFormat<__half, 16, false>(pg[l], plan_gu, Fusion{true, true}, false, st);
          default: return LaunchFormat<__half, 16, false>(pd[l], plan_dn, Fusion{false, false}, false, st);
        }
      }, &us));
      printf("  layer: stand-in prefetch %-13s qkv tail -> o %-3s tail %4.1f MB: %7.2f us\n",
             stand_pf ? "o + 4 MB gu" : "none", q_tail ? "yes" : "no", tail * 1e-6, 5 * us);
      fflush(stdout);
    };
    layer_time(0, false, 0);
    layer_time(1, false, 0);
    layer_time(0, true, 0);
    for (size_t tail : {size_t(1) << 20, size_t(2) << 20, size_t(4) << 20, size_t(8) << 20}) layer_time(0, true, tail);
    for (size_t tail : {size_t(2) << 20, size_t(4) << 20}) layer_time(0, false, tail);
    layer_time(1, false, size_t(4) << 20);
    layer_time(0, false, 0);  // the baseline again (drift)
    for (int i = 0; i < L; ++i) {
      for (void* p : {(void*)qw[i], (void*)ow[i], (void*)gu[i], (void*)dn[i], (void*)kv[i], (void*)yq[i], (void*)hbuf[i],
                      (void*)yo[i], (void*)y2[i]}) {
        cudaFree(p);
      }
    }
    cudaFree(x);
    cudaFree(gamma);
    cudaFree(res);
  }
  return 0;
}
