// Probe: the GEMV engine's dense row kernel (ffi/kernels/gemv/dense_row.cuh: one row of dense half
// weights, W straight into registers as MMA operands) against its ring kernel (kernel.cuh,
// DenseWeights) and a kernel that only reads W, on a ~1B and a ~8B decoder's projections, f16,
// with each shape's fusion (RMS norm, gated SiLU); chains of launches on distinct weights in a CUDA
// graph (child graphs, as XLA records FFI calls). Checks that both kernels agree within f16
// rounding. The variant sweep behind the kernel's geometry (warps a tile 1-8, depth 2-4, 2 or 3
// CTAs an SM) was this probe at 8bafb4e (its own copy of the kernel, templated on those);
// bench/results/2026-12-02-gemv-dense-row.json.
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -diag-suppress=940,2473,128 -I ffi -I tools/probes tools/probes/gemv_dense_m1.cu \
//     ffi/kernels/gemv/inst/gemv_f16_dense.cu -o gemv_dense_m1
// Env: JOA_PROBE_8B=1 adds the ~8B shapes (2: only them); JOA_PROBE_ONLY=<shape prefix>.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "graph_chain.h"
#include "kernels/gemv/gemv.h"
#include "kernels/gemv/plan.h"
#include "one_row.h"
#include "probe_util.h"

using namespace joa::gemv;

int main() {
  ProbeEnv env;
  CK(MakeProbeEnv(env));
  cudaStream_t s = env.stream;
  printf("us a call (GB/s of W): stream (reads W only), ring, dense row; max|row - ring| (max|ring|)\n");
  for (const Shape& sh : kDecoderShapes) {
    if (!ProbeWants(sh)) continue;
    const size_t wbytes = size_t(sh.n) * sh.k * 2;
    const int L = std::max<int>(2, std::min<size_t>(24, (size_t(400) << 20) / wbytes + 1));  // past the L2
    const Fusion f{sh.gated, sh.norm};
    const Plan ring = MakePlan(1, sh.n, sh.k, 16, sh.gated, sh.norm, true);
    const Plan row = MakePlan(1, sh.n, sh.k, 16, sh.gated, sh.norm, true, 0, 0, false, 0, /*slots=*/true);
    if (!ring.error.empty() || !row.dense_row) {
      printf("%s: no plan (%s)\n", sh.name, ring.error.c_str());
      continue;
    }
    __half *x, *gamma;
    CK(cudaMalloc(&x, sh.k * 2));
    FillHalf<<<64, 256>>>(x, sh.k, 1, -1.f, 1.f);
    CK(cudaMalloc(&gamma, sh.k * 2));
    FillHalf<<<64, 256>>>(gamma, sh.k, 2, 0.5f, 1.5f);
    std::vector<__half*> ws(L), ys(L);
    std::vector<GemvParams> ps(L);
    for (int i = 0; i < L; ++i) {
      CK(cudaMalloc(&ws[i], wbytes));
      FillHalf<<<1024, 256>>>(ws[i], wbytes / 2, 10 + i, -0.05f, 0.05f);
      CK(cudaMalloc(&ys[i], size_t(sh.n) * 2));
      ps[i] = OneRowParams(x, ws[i], nullptr, nullptr, sh.norm ? gamma : nullptr, ys[i], sh.k, sh.n, sh.gated);
      ps[i].k_blocks = 0;
      ps[i].block_shift = 0;
    }
    CK(cudaDeviceSynchronize());
    auto time = [&](auto&& launch, float* us) { return TimeGraphChain(L, launch, true, s, 50, 3, us); };
    float t_stream, t_ring, t_row;
    CK(time([&](int i, cudaStream_t st) {
      StreamKernel<<<4 * env.sms, kThreads, 0, st>>>(ws[i], wbytes / 16, env.sink);
      return cudaGetLastError();
    }, &t_stream));
    CK(time([&](int i, cudaStream_t st) { return LaunchFormat<__half, 16, false>(ps[i], ring, f, false, st); }, &t_ring));
    CK(time([&](int i, cudaStream_t st) { return LaunchFormat<__half, 16, false>(ps[i], row, f, false, st); }, &t_row));
    const int n_out = ps[0].n_out;
    std::vector<__half> y_ring(n_out), y_row(n_out);
    CK(LaunchFormat<__half, 16, false>(ps[0], ring, f, false, s));
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(y_ring.data(), ys[0], n_out * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemset(ys[0], 0xff, n_out * 2));
    CK(LaunchFormat<__half, 16, false>(ps[0], row, f, false, s));
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(y_row.data(), ys[0], n_out * 2, cudaMemcpyDeviceToHost));
    float err = 0.f, ymax = 0.f;
    for (int r = 0; r < n_out; ++r) {
      ymax = std::max(ymax, std::fabs(__half2float(y_ring[r])));
      const float d = std::fabs(__half2float(y_row[r]) - __half2float(y_ring[r]));
      err = std::max(err, std::isnan(d) ? 1e30f : d);
    }
    const double kb = wbytes * 1e-3;
    printf("%-34s stream %7.2f (%4.0f)  ring %7.2f (%4.0f)  row %7.2f (%4.0f)  grid %d  %.4g (%.4g)\n", sh.name,
           t_stream, kb / t_stream, t_ring, kb / t_ring, t_row, kb / t_row, row.grid, err, ymax);
    fflush(stdout);
    for (int i = 0; i < L; ++i) {
      cudaFree(ws[i]);
      cudaFree(ys[i]);
    }
    cudaFree(x);
    cudaFree(gamma);
  }
  return 0;
}
