// Probe (session 41, not yet run): the slots kernel (ffi/kernels/gemv/slots.cuh, one row of 4-bit
// wide weights, f16, block 32, zero points) with a CTA barrier at the end of every 16-row tile, as
// the engine runs it, against its kDefer form (each tile's warp sums in a shared-memory slot of its
// own, one barrier and all the epilogues at the end: the same sums in the same order), on the ~1B
// (and with JOA_PROBE_8B=1 also the ~8B) decoder projections. Why: at K = 2048 each warp streams
// one 2.4 KB chunk of a tile and then waits for the CTA (cpp 1), so the ~1B qkv / o / gate-up / LM
// head stop every chunk; the 4-bit fused MLP's gate / up phase (mlp_nbits.cuh) has no such barrier.
// Chains of L launches on distinct weights in a CUDA graph (each launch its own child graph, as XLA
// records FFI calls); a W-only stream kernel of the same bytes as the floor. Checks that the two
// forms give the same bits. Shapes whose CTAs hold more than kDeferTiles tiles are skipped.
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -diag-suppress=940,2473 -I ffi -I tools/probes tools/probes/slots_defer.cu -o /tmp/slots_defer
//   JOA_PROBE_8B=1 /tmp/slots_defer
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/gemv/gemv.h"
#include "kernels/gemv/launch.cuh"  // LaunchSlotsKernel, ApplyPlan (both forms instantiated here)
#include "graph_chain.h"
#include "one_row.h"
#include "probe_util.h"

using namespace joa::gemv;

enum Variant { kStream, kSlots, kDeferred };

static cudaError_t Launch(Variant v, GemvParams p, const Plan& plan, Fusion f, cudaStream_t s) {
  if (v == kStream) {
    StreamKernel<<<4 * kPlanSms, kThreads, 0, s>>>(p.w, size_t(p.n_rows) * p.k / 32, static_cast<uint32_t*>(p.y));
    return cudaGetLastError();
  }
  ApplyPlan(p, plan, false);
  return WithPolicies(f, [&](auto pol) {
    using P = decltype(pol);
    return v == kSlots
               ? LaunchSlotsKernel<__half, SlotFormat<__half>, typename P::Prologue, typename P::Epilogue, false>(
                     p, plan, false, s)
               : LaunchSlotsKernel<__half, SlotFormat<__half>, typename P::Prologue, typename P::Epilogue, true>(
                     p, plan, false, s);
  });
}

int main() {
  const int block = 32;  // one_row.h's metadata
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  printf("%-34s %8s %8s %8s   grid tiles/CTA cpp  same bits\n", "shape (us a call)", "stream", "slots", "deferred");
  for (const Shape& sh : kDecoderShapes) {
    if (!ProbeWants(sh)) continue;
    const int kb = sh.k / block;
    const size_t wbytes = size_t(sh.n) * sh.k / 2;
    const int L = sh.n > 100000 ? 4 : 24;  // distinct weights: together past the 50 MB L2
    const Fusion f{sh.gated, sh.norm};
    const Plan plan = MakePlan(1, sh.n, sh.k, 4, sh.gated, sh.norm, true, 0, 0, true, block, true);
    if (!plan.error.empty() || !plan.slots) {
      printf("%s: no slots plan (%s)\n", sh.name, plan.error.c_str());
      continue;
    }
    const int tiles_per_cta = (plan.blocks + plan.grid - 1) / plan.grid;
    __half *x, *gamma, *scales;
    uint8_t* zeros;
    CK(cudaMalloc(&x, sh.k * 2));
    FillHalf<<<64, 256>>>(x, sh.k, 1, -1.f, 1.f);
    CK(cudaMalloc(&gamma, sh.k * 2));
    FillHalf<<<64, 256>>>(gamma, sh.k, 2, 0.5f, 1.5f);
    const size_t meta = size_t((sh.n + 15) / 16) * kb * 16;
    CK(cudaMalloc(&scales, meta * 2 * L));
    FillHalf<<<256, 256>>>(scales, meta * L, 3, 0.001f, 0.01f);
    CK(cudaMalloc(&zeros, meta * L));
    Fill<<<256, 256>>>(zeros, meta * L, 4, 15);
    std::vector<void*> ws(L), ys(L);
    std::vector<GemvParams> ps(L);
    for (int i = 0; i < L; ++i) {
      CK(cudaMalloc(&ws[i], wbytes));
      Fill<<<1024, 256>>>(static_cast<uint8_t*>(ws[i]), wbytes, 10 + i, 0xFF);
      CK(cudaMalloc(&ys[i], size_t(sh.n) * 2));
      ps[i] = OneRowParams(x, ws[i], scales + meta * i, zeros + meta * i, sh.norm ? gamma : nullptr, ys[i], sh.k,
                           sh.n, sh.gated);
    }
    CK(cudaDeviceSynchronize());
    const bool deferrable = tiles_per_cta <= kDeferTiles;
    bool same = true;
    if (deferrable) {
      const int n_out = ps[0].n_out;
      std::vector<__half> a(n_out), b(n_out);
      CK(Launch(kSlots, ps[0], plan, f, s));
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(a.data(), ys[0], n_out * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemset(ys[0], 0xff, n_out * 2));
      CK(Launch(kDeferred, ps[0], plan, f, s));
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(b.data(), ys[0], n_out * 2, cudaMemcpyDeviceToHost));
      same = std::memcmp(a.data(), b.data(), n_out * 2) == 0;
    }
    printf("%-34s", sh.name);
    for (Variant v : {kStream, kSlots, kDeferred}) {
      if (v == kDeferred && !deferrable) {
        printf(" %8s", "-");
        continue;
      }
      float t;
      CK(TimeGraphChain(L, [&](int i, cudaStream_t st) { return Launch(v, ps[i], plan, f, st); }, true, s, 50, 3, &t));
      printf(" %8.2f", t);
    }
    printf("   %4d %9d %3d  %s\n", plan.grid, tiles_per_cta, plan.cpp, deferrable ? (same ? "yes" : "NO") : "-");
    fflush(stdout);
    for (int i = 0; i < L; ++i) {
      CK(cudaFree(ws[i]));
      CK(cudaFree(ys[i]));
    }
    CK(cudaFree(x));
    CK(cudaFree(gamma));
    CK(cudaFree(scales));
    CK(cudaFree(zeros));
  }
  return 0;
}
