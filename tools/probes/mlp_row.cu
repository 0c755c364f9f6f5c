// Probe: the gated MLP of one decode row as one cooperative kernel (ffi/kernels/gemv/mlp_row.cuh)
// against today's two dense row GEMVs (gate-up with the norm and the gated SiLU, then down with the
// residual), each launch its own child graph as XLA records FFI calls; L layers on distinct weights
// (past the L2). Prints µs a layer, the bytes' rate, and max |fused - two kernels| (max |y|).
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -diag-suppress=940,2473,128 -I ffi -I tools/probes tools/probes/mlp_row.cu \
//     ffi/kernels/gemv/inst/gemv_f16_dense.cu -o mlp_row
// Also the N split (JOA_GATED_MLP_SPLIT=n; since session 39 the two-phase row chain, row_chain.cuh):
// h to global, one grid barrier, then whole rows of y a CTA (no partials), the down tiles' first W
// in flight across it; at 8 warps it adds in the dense row kernel's order (max |N - two| printed: 0
// expected).
// Env: JOA_PROBE_8B=1 adds the ~8B MLP (2: only it).
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

template <int kW, int kDepth>
cudaError_t LaunchMlp(const MlpRowParams& p, int grid, cudaStream_t s) {
  return LaunchCooperative(MlpRowKernel<__half, kW, kDepth, true>, p, grid, kW * 32,
                           MlpRowSmem<kW>::Bytes(p.h, p.tiles_per_cta), s);
}

// The N split: the two-phase row chain (row_chain.cuh) at kW x kDepth, h in p.partials' bytes.
template <int kW, int kDepth>
cudaError_t LaunchMlpN(const MlpRowParams& p, int grid, cudaStream_t s) {
  RowChainParams c = GatedMlpChain(p.h, p.inter, p.x, p.gamma, p.w_gu, p.w_down, p.residual, p.partials, p.y);
  c.eps = p.eps;
  return LaunchCooperative(RowChainKernel<__half, kW, kDepth>, c, grid, kW * 32, RowChainSmemBytes<kW>(RowChainMaxK(c)),
                           s);
}

struct Mlp {
  const char* name;
  int h, inter;
};

int main() {
  ProbeEnv env;
  CK(MakeProbeEnv(env));
  cudaStream_t s = env.stream;
  const int with_8b = getenv("JOA_PROBE_8B") ? atoi(getenv("JOA_PROBE_8B")) : 0;
  const Mlp mlps[] = {{"1b 2048x8192", 2048, 8192}, {"8b 4096x14336", 4096, 14336}};
  printf("us a layer (GB/s): stream W only, two dense row GEMVs, fused (warps, depth); max|fused - two| (max|y|)\n");
  for (const Mlp& m : mlps) {
    const bool is_8b = m.h == 4096;
    if (is_8b ? with_8b == 0 : with_8b == 2) continue;
    const int H = m.h, I = m.inter;
    const size_t gu_bytes = size_t(2) * I * H * 2, dn_bytes = size_t(H) * I * 2;
    const int L = std::max<int>(2, int((size_t(600) << 20) / (gu_bytes + dn_bytes)) + 1);
    // The grid: the most CTAs <= SMs with (I / 8) % G == 0 and a 64-wide h slice multiple.
    int grid = 0;
    for (int gr = env.sms; gr > 0; --gr) {
      if (MlpRowFits<8>(H, I, gr) && MlpRowFits<16>(H, I, gr)) {
        grid = gr;
        break;
      }
    }
    if (grid == 0) {
      printf("%s: no grid\n", m.name);
      continue;
    }
    __half *x, *gamma, *res;
    float* partials;
    CK(cudaMalloc(&x, H * 2));
    CK(cudaMalloc(&gamma, H * 2));
    CK(cudaMalloc(&res, H * 2));
    CK(cudaMalloc(&partials, size_t(grid) * H * 4));
    FillHalf<<<64, 256>>>(x, H, 1, -1.f, 1.f);
    FillHalf<<<64, 256>>>(gamma, H, 2, 0.5f, 1.5f);
    FillHalf<<<64, 256>>>(res, H, 3, -1.f, 1.f);
    std::vector<__half*> gu(L), dn(L), hbuf(L), y2(L), yf(L);
    std::vector<GemvParams> pg(L), pd(L);
    std::vector<MlpRowParams> pf(L);
    const Plan plan_gu = MakePlan(1, 2 * I, H, 16, true, true, true, 0, 0, false, 0, true);
    const Plan plan_dn = MakePlan(1, H, I, 16, false, false, true, 0, 0, false, 0, true);
    if (!plan_gu.dense_row || !plan_dn.dense_row) {
      printf("%s: no dense row plan (%s %s)\n", m.name, plan_gu.error.c_str(), plan_dn.error.c_str());
      continue;
    }
    for (int i = 0; i < L; ++i) {
      CK(cudaMalloc(&gu[i], gu_bytes));
      CK(cudaMalloc(&dn[i], dn_bytes));
      FillHalf<<<1024, 256>>>(gu[i], gu_bytes / 2, 10 + i, -0.05f, 0.05f);
      FillHalf<<<1024, 256>>>(dn[i], dn_bytes / 2, 100 + i, -0.05f, 0.05f);
      CK(cudaMalloc(&hbuf[i], I * 2));
      CK(cudaMalloc(&y2[i], H * 2));
      CK(cudaMalloc(&yf[i], H * 2));
      pg[i] = OneRowParams(x, gu[i], nullptr, nullptr, gamma, hbuf[i], H, 2 * I, true);
      pd[i] = OneRowParams(hbuf[i], dn[i], nullptr, nullptr, nullptr, y2[i], I, H, false);
      pg[i].k_blocks = pd[i].k_blocks = 0;
      pg[i].block_shift = pd[i].block_shift = 0;
      pd[i].residual = res;
      MlpRowParams f{};
      f.x = x;
      f.gamma = gamma;
      f.w_gu = gu[i];
      f.w_down = dn[i];
      f.residual = res;
      f.y = yf[i];
      f.partials = partials;
      f.eps = 1e-6f;
      f.h = H;
      f.inter = I;
      f.tiles_per_cta = I / 8 / grid;
      pf[i] = f;
    }
    CK(cudaDeviceSynchronize());
    auto time = [&](int n, auto&& launch, float* us) { return TimeGraphChain(n, launch, true, s, 30, 3, us); };
    const double mb = (gu_bytes + dn_bytes) * 1e-3;
    float t_stream, t_two;
    CK(time(2 * L, [&](int i, cudaStream_t st) {
      if (i & 1) StreamKernel<<<4 * env.sms, kThreads, 0, st>>>(dn[i / 2], dn_bytes / 16, env.sink);
      else StreamKernel<<<4 * env.sms, kThreads, 0, st>>>(gu[i / 2], gu_bytes / 16, env.sink);
      return cudaGetLastError();
    }, &t_stream));
    CK(time(2 * L, [&](int i, cudaStream_t st) {
      return (i & 1) ? LaunchFormat<__half, 16, false>(pd[i / 2], plan_dn, Fusion{false, false}, false, st)
                     : LaunchFormat<__half, 16, false>(pg[i / 2], plan_gu, Fusion{true, true}, false, st);
    }, &t_two));
    printf("%-16s grid %d  stream %7.2f (%4.0f)  two %7.2f (%4.0f)\n", m.name, grid, 2 * t_stream,
           mb / (2 * t_stream), 2 * t_two, mb / (2 * t_two));
    std::vector<__half> a(H), b(H);
    CK(LaunchFormat<__half, 16, false>(pg[0], plan_gu, Fusion{true, true}, false, s));
    CK(LaunchFormat<__half, 16, false>(pd[0], plan_dn, Fusion{false, false}, false, s));
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(a.data(), y2[0], H * 2, cudaMemcpyDeviceToHost));
    auto variant = [&](const char* name, auto&& launch) -> int {
      float t;
      CK(time(L, [&](int i, cudaStream_t st) { return launch(pf[i], st); }, &t));
      CK(cudaMemset(yf[0], 0xff, H * 2));
      CK(launch(pf[0], s));
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(b.data(), yf[0], H * 2, cudaMemcpyDeviceToHost));
      float err = 0.f, ymax = 0.f;
      for (int r = 0; r < H; ++r) {
        ymax = std::max(ymax, std::fabs(__half2float(a[r])));
        const float d = std::fabs(__half2float(b[r]) - __half2float(a[r]));
        err = std::max(err, std::isnan(d) ? 1e30f : d);
      }
      // Repeatability: a second run gives the same bits.
      std::vector<__half> c(H);
      CK(launch(pf[0], s));
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(c.data(), yf[0], H * 2, cudaMemcpyDeviceToHost));
      int diff = 0;
      for (int r = 0; r < H; ++r) diff += __half_as_ushort(b[r]) != __half_as_ushort(c[r]);
      printf("  fused %-7s %7.2f (%4.0f)  %.4g (%.4g)  rerun diffs %d\n", name, t, mb / t, err, ymax, diff);
      fflush(stdout);
      return 0;
    };
    if (variant("8x3", [&](const MlpRowParams& p, cudaStream_t st) { return LaunchMlp<8, 3>(p, grid, st); })) return 1;
    if (variant("8x4", [&](const MlpRowParams& p, cudaStream_t st) { return LaunchMlp<8, 4>(p, grid, st); })) return 1;
    if (variant("8x6", [&](const MlpRowParams& p, cudaStream_t st) { return LaunchMlp<8, 6>(p, grid, st); })) return 1;
    if (variant("16x2", [&](const MlpRowParams& p, cudaStream_t st) { return LaunchMlp<16, 2>(p, grid, st); })) return 1;
    if (variant("16x3", [&](const MlpRowParams& p, cudaStream_t st) { return LaunchMlp<16, 3>(p, grid, st); })) return 1;
    if (variant("16x4", [&](const MlpRowParams& p, cudaStream_t st) { return LaunchMlp<16, 4>(p, grid, st); })) return 1;
    // The N split: its own grid (the tree's rule; its h, I of T, fits in the partials' bytes).
    const int grid_n = RowChainGrid(GatedMlpShapes(H, I), env.sms);
    printf("  N-split grid %d\n", grid_n);
    if (variant("N 8x3", [&](const MlpRowParams& p, cudaStream_t st) { return LaunchMlpN<8, 3>(p, grid_n, st); })) return 1;
    if (variant("N 8x4", [&](const MlpRowParams& p, cudaStream_t st) { return LaunchMlpN<8, 4>(p, grid_n, st); })) return 1;
    if (variant("N 16x2", [&](const MlpRowParams& p, cudaStream_t st) { return LaunchMlpN<16, 2>(p, grid_n, st); })) return 1;
    if (variant("N 16x3", [&](const MlpRowParams& p, cudaStream_t st) { return LaunchMlpN<16, 3>(p, grid_n, st); })) return 1;
    if (variant("N 16x4", [&](const MlpRowParams& p, cudaStream_t st) { return LaunchMlpN<16, 4>(p, grid_n, st); })) return 1;
    for (int i = 0; i < L; ++i) {
      cudaFree(gu[i]);
      cudaFree(dn[i]);
      cudaFree(hbuf[i]);
      cudaFree(y2[i]);
      cudaFree(yf[i]);
    }
    cudaFree(x);
    cudaFree(gamma);
    cudaFree(res);
    cudaFree(partials);
  }
  return 0;
}
