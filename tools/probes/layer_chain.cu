// Probe: a decode layer's GEMVs after the attention as ONE persistent kernel. Session 39's question
// for issue 12: what is left of a ~1B / ~8B B=1 layer's GEMV time if the four projections between
// two attentions (o + residual, norm + gate / up + SiLU·up, down + residual, norm + the next layer's
// QKV) run as phases of one cooperative launch, a grid barrier between phases and the next phase's
// first W already in flight across each barrier (W does not depend on the phase before), instead of
// 3-4 launches each paying a ramp, a drain and a boundary. The attention would stay its own kernel
// between two such chains: 2 kernels a layer instead of today's 4 (76 a ~1B step -> ~34).
//
// The chain is the tree's RowChainKernel (ffi/kernels/gemv/row_chain.cuh, the out_mlp target's three
// phases): each phase splits N, CTA c takes 16-row tiles c, c + G, ... over all of K (warps split K),
// adds its warps' sums in warp order and applies the epilogue itself: no partials. At 8 warps each
// phase adds in the dense row kernel's order, so the chain should give the separate kernels' bits
// (max |chain - kernels| printed: 0 expected at 8 x 3 and 8 x 4; depth does not change the sums).
//
// Timed (µs a layer, L layers on distinct weights past the L2, each launch its own child graph as XLA
// records FFI calls): W-only streams of the four weights; the four dense row GEMVs; o + the fused MLP
// (K split, 16 x 2: today's default) + qkv; the chain of four phases at several warps x depths and
// grids; the chain of three (o + the MLP: a cut inside one layer, the QKV projection keeping its own
// fused kernel with the step preparation) then qkv's kernel.
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -diag-suppress=940,2473,128 -I ffi -I tools/probes tools/probes/layer_chain.cu \
//     ffi/kernels/gemv/inst/gemv_f16_dense.cu -o layer_chain
// Env: JOA_PROBE_8B=1 adds the ~8B layer (2: only it).
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "graph_chain.h"
#include "kernels/gemv/cooperative.h"
#include "kernels/gemv/gemv.h"
#include "kernels/gemv/mlp_row.cuh"
#include "kernels/gemv/plan.h"
#include "kernels/gemv/row_chain.cuh"
#include "one_row.h"
#include "probe_util.h"

using namespace joa::gemv;

// The tree's kernel (row_chain.cuh) at kW warps x kDepth steps in flight.
template <int kW, int kDepth>
cudaError_t LaunchChain(const RowChainParams& p, int grid, cudaStream_t s) {
  return LaunchCooperative(RowChainKernel<__half, kW, kDepth>, p, grid, kW * 32, RowChainSmemBytes<kW>(RowChainMaxK(p)),
                           s);
}

template <int kW, int kDepth>
cudaError_t LaunchMlpK(const MlpRowParams& p, int grid, cudaStream_t s) {
  return LaunchCooperative(MlpRowKernel<__half, kW, kDepth, true>, p, grid, kW * 32,
                           MlpRowSmem<kW>::Bytes(p.h, p.tiles_per_cta), s);
}

struct LayerShape {
  const char* name;
  int h, inter, n_qkv;
};

struct LayerW {
  __half *wo, *wgu, *wdn, *wqkv;
};

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // piped into tee under `timeout`: keep every finished line if killed
  ProbeEnv env;
  CK(MakeProbeEnv(env));
  cudaStream_t s = env.stream;
  const int with_8b = getenv("JOA_PROBE_8B") ? atoi(getenv("JOA_PROBE_8B")) : 0;
  // QKV rows: 32 query heads + 2 x 8 KV heads of the head size (64 at ~1B, 128 at ~8B).
  const LayerShape shapes[] = {{"1b", 2048, 8192, 2048 + 2 * 8 * 64}, {"8b", 4096, 14336, 4096 + 2 * 8 * 128}};
  printf("us a layer (GB/s) of o + gate-up + down + qkv; max |chain - kernels| of the layer's x and qkv\n");
  for (const LayerShape& m : shapes) {
    const bool is_8b = m.h == 4096;
    if (is_8b ? with_8b == 0 : with_8b == 2) continue;
    const int H = m.h, I = m.inter, NQ = m.n_qkv;
    const size_t bo = size_t(H) * H * 2, bgu = size_t(2) * I * H * 2, bdn = size_t(H) * I * 2,
                 bqkv = size_t(NQ) * H * 2, layer_bytes = bo + bgu + bdn + bqkv;
    const int L = std::max<int>(2, int((size_t(600) << 20) / layer_bytes) + 1);
    __half *attn, *x0, *gamma1, *gamma2, *x1, *hid, *x2, *qkv, *x1c, *hidc, *x2c, *qkvc;
    for (auto* ptr : {&attn, &x0, &gamma1, &gamma2, &x1, &x2, &x1c, &x2c}) CK(cudaMalloc(ptr, H * 2));
    CK(cudaMalloc(&hid, I * 2));
    CK(cudaMalloc(&hidc, I * 2));
    CK(cudaMalloc(&qkv, NQ * 2));
    CK(cudaMalloc(&qkvc, NQ * 2));
    FillHalf<<<64, 256>>>(attn, H, 1, -1.f, 1.f);
    FillHalf<<<64, 256>>>(x0, H, 2, -1.f, 1.f);
    FillHalf<<<64, 256>>>(gamma1, H, 3, 0.5f, 1.5f);
    FillHalf<<<64, 256>>>(gamma2, H, 4, 0.5f, 1.5f);
    std::vector<LayerW> lw(L);
    for (int i = 0; i < L; ++i) {
      CK(cudaMalloc(&lw[i].wo, bo));
      CK(cudaMalloc(&lw[i].wgu, bgu));
      CK(cudaMalloc(&lw[i].wdn, bdn));
      CK(cudaMalloc(&lw[i].wqkv, bqkv));
      FillHalf<<<1024, 256>>>(lw[i].wo, bo / 2, 10 + i, -0.03f, 0.03f);
      FillHalf<<<1024, 256>>>(lw[i].wgu, bgu / 2, 100 + i, -0.05f, 0.05f);
      FillHalf<<<1024, 256>>>(lw[i].wdn, bdn / 2, 200 + i, -0.05f, 0.05f);
      FillHalf<<<1024, 256>>>(lw[i].wqkv, bqkv / 2, 300 + i, -0.05f, 0.05f);
    }
    CK(cudaDeviceSynchronize());
    const Plan plan_o = MakePlan(1, H, H, 16, false, false, true, 0, 0, false, 0, true);
    const Plan plan_gu = MakePlan(1, 2 * I, H, 16, true, true, true, 0, 0, false, 0, true);
    const Plan plan_dn = MakePlan(1, H, I, 16, false, false, true, 0, 0, false, 0, true);
    const Plan plan_qkv = MakePlan(1, NQ, H, 16, false, true, true, 0, 0, false, 0, true);
    if (!plan_o.dense_row || !plan_gu.dense_row || !plan_dn.dense_row || !plan_qkv.dense_row) {
      printf("%s: no dense row plan\n", m.name);
      continue;
    }
    // The separate kernels (outputs x1, hid, x2, qkv) and the chain's (x1c, hidc, x2c, qkvc).
    auto kernel = [&](int i, int which, cudaStream_t st) -> cudaError_t {
      const LayerW& w = lw[i];
      GemvParams q;
      switch (which) {
        case 0:
          q = OneRowParams(attn, w.wo, nullptr, nullptr, nullptr, x1, H, H, false);
          q.residual = x0;
          q.k_blocks = q.block_shift = 0;
          return LaunchFormat<__half, 16, false>(q, plan_o, Fusion{false, false}, false, st);
        case 1:
          q = OneRowParams(x1, w.wgu, nullptr, nullptr, gamma1, hid, H, 2 * I, true);
          q.k_blocks = q.block_shift = 0;
          return LaunchFormat<__half, 16, false>(q, plan_gu, Fusion{true, true}, false, st);
        case 2:
          q = OneRowParams(hid, w.wdn, nullptr, nullptr, nullptr, x2, I, H, false);
          q.residual = x1;
          q.k_blocks = q.block_shift = 0;
          return LaunchFormat<__half, 16, false>(q, plan_dn, Fusion{false, false}, false, st);
        default:
          q = OneRowParams(x2, w.wqkv, nullptr, nullptr, gamma2, qkv, H, NQ, false);
          q.k_blocks = q.block_shift = 0;
          return LaunchFormat<__half, 16, false>(q, plan_qkv, Fusion{false, true}, false, st);
      }
    };
    auto chain_params = [&](int i) {
      const LayerW& w = lw[i];
      // out_mlp's three phases (the tree's), then the next layer's norm + QKV.
      RowChainParams c = OutMlpChain(H, H, I, attn, w.wo, x0, gamma1, w.wgu, w.wdn, x1c, hidc, x2c);
      c.phases = 4;
      c.eps = 1e-6f;
      c.ph[3] = {w.wqkv, x2c, gamma2, nullptr, qkvc, H, NQ, 0};
      return c;
    };
    // Today's default between two attentions: o, the fused MLP (K split, 16 x 2), qkv.
    int grid_k = 0;
    for (int gr = env.sms; gr > 0 && grid_k == 0; --gr) grid_k = MlpRowFits<16>(H, I, gr) ? gr : 0;
    float* partials;
    CK(cudaMalloc(&partials, size_t(std::max(grid_k, 1)) * H * 4));
    auto mlp_params = [&](int i) {
      MlpRowParams f{};
      f.x = x1;
      f.gamma = gamma1;
      f.w_gu = lw[i].wgu;
      f.w_down = lw[i].wdn;
      f.residual = x1;
      f.y = x2;
      f.partials = partials;
      f.eps = 1e-6f;
      f.h = H;
      f.inter = I;
      f.tiles_per_cta = grid_k ? I / 8 / grid_k : 0;
      return f;
    };

    auto time = [&](int n, auto&& launch, float* us) { return TimeGraphChain(n, launch, true, s, 30, 3, us); };
    const double mb = layer_bytes * 1e-3;
    float t;
    const size_t sizes[4] = {bo, bgu, bdn, bqkv};
    CK(time(4 * L, [&](int i, cudaStream_t st) {
      const LayerW& w = lw[i / 4];
      const __half* ptrs[4] = {w.wo, w.wgu, w.wdn, w.wqkv};
      StreamKernel<<<4 * env.sms, kThreads, 0, st>>>(ptrs[i % 4], sizes[i % 4] / 16, env.sink);
      return cudaGetLastError();
    }, &t));
    printf("%s H %d I %d qkv %d: %.1f MB a layer, L %d\n", m.name, H, I, NQ, layer_bytes / 1e6, L);
    printf("  stream W, 4 launches    %7.2f (%4.0f)\n", 4 * t, mb / (4 * t));
    CK(time(4 * L, [&](int i, cudaStream_t st) { return kernel(i / 4, i % 4, st); }, &t));
    printf("  4 dense row GEMVs       %7.2f (%4.0f)\n", 4 * t, mb / (4 * t));
    if (grid_k) {
      CK(time(3 * L, [&](int i, cudaStream_t st) -> cudaError_t {
        const int l = i / 3, which = i % 3;
        if (which == 0) return kernel(l, 0, st);
        if (which == 2) return kernel(l, 3, st);
        return LaunchMlpK<16, 2>(mlp_params(l), grid_k, st);
      }, &t));
      printf("  o, fused MLP (K 16x2, grid %d), qkv  %7.2f (%4.0f)\n", grid_k, 3 * t, mb / (3 * t));
    }
    // The reference bits: layer 0 by the separate kernels.
    for (int which = 0; which < 4; ++which) CK(kernel(0, which, s));
    CK(cudaStreamSynchronize(s));
    std::vector<__half> want_x(H), want_q(NQ), got_x(H), got_q(NQ);
    CK(cudaMemcpy(want_x.data(), x2, H * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(want_q.data(), qkv, NQ * 2, cudaMemcpyDeviceToHost));
    auto max_diff = [](const std::vector<__half>& a, const std::vector<__half>& b) {
      float e = 0.f;
      for (size_t r = 0; r < a.size(); ++r) {
        const float d = std::fabs(__half2float(a[r]) - __half2float(b[r]));
        e = std::max(e, std::isnan(d) ? 1e30f : d);
      }
      return e;
    };
    // phases 4: o .. qkv in one launch; 3: o + the MLP in one launch, then qkv's own kernel.
    int phases = 4;
    auto chain = [&](const char* name, int grid, auto&& launch) -> int {
      float tc;
      // One CTA an SM (every variant's registers: 8 x 168-184, 16 x 128): a cooperative launch of more
      // CTAs than SMs fails (cudaErrorCooperativeLaunchTooLarge) and CK would end the whole probe.
      if (grid > env.sms) {
        printf("  %-5s grid %3d: more CTAs than SMs, skipped\n", name, grid);
        return 0;
      }
      if (phases == 4) {
        CK(time(L, [&](int i, cudaStream_t st) { return launch(chain_params(i), grid, st); }, &tc));
      } else {
        CK(time(2 * L, [&](int i, cudaStream_t st) -> cudaError_t {
          if (i & 1) return kernel(i / 2, 3, st);
          RowChainParams c = chain_params(i / 2);
          c.phases = 3;
          return launch(c, grid, st);
        }, &tc));
        tc *= 2;
      }
      // On s: the legacy default stream does not order against the non-blocking stream s.
      for (__half* b : {x1c, x2c}) CK(cudaMemsetAsync(b, 0xff, H * 2, s));
      CK(cudaMemsetAsync(hidc, 0xff, I * 2, s));
      CK(cudaMemsetAsync(qkvc, 0xff, NQ * 2, s));
      RowChainParams c0 = chain_params(0);
      c0.phases = phases;
      CK(launch(c0, grid, s));
      if (phases == 3) {  // qkv from the chain's x by the kernel, into the chain's qkv buffer
        GemvParams q = OneRowParams(x2c, lw[0].wqkv, nullptr, nullptr, gamma2, qkvc, H, NQ, false);
        q.k_blocks = q.block_shift = 0;
        CK(LaunchFormat<__half, 16, false>(q, plan_qkv, Fusion{false, true}, false, s));
      }
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(got_x.data(), x2c, H * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(got_q.data(), qkvc, NQ * 2, cudaMemcpyDeviceToHost));
      printf("  %s %-5s grid %3d  %7.2f (%4.0f)  x %.4g  qkv %.4g\n", phases == 4 ? "chain 4  " : "chain 3+1", name,
             grid, tc, mb / tc,
             max_diff(want_x, got_x), max_diff(want_q, got_q));
      fflush(stdout);
      return 0;
    };
    for (int grid : {128, env.sms}) {
      if (chain("8x3", grid, LaunchChain<8, 3>)) return 1;
      if (chain("8x4", grid, LaunchChain<8, 4>)) return 1;
      if (chain("16x2", grid, LaunchChain<16, 2>)) return 1;
      if (chain("16x3", grid, LaunchChain<16, 3>)) return 1;
    }
    phases = 3;
    if (chain("8x3", 128, LaunchChain<8, 3>)) return 1;
    if (chain("8x4", 128, LaunchChain<8, 4>)) return 1;
    if (chain("16x2", 128, LaunchChain<16, 2>)) return 1;
    for (auto& w : lw) {
      cudaFree(w.wo);
      cudaFree(w.wgu);
      cudaFree(w.wdn);
      cudaFree(w.wqkv);
    }
    for (auto* ptr : {attn, x0, gamma1, gamma2, x1, hid, x2, qkv, x1c, hidc, x2c, qkvc}) cudaFree(ptr);
    cudaFree(partials);
  }
  return 0;
}
