// Probe: what a decode step's GEMVs cost inside a CUDA graph, launched the way XLA's command
// buffers do today (each FFI call its own child graph: no programmatic edges between calls) and
// the way one FFI call with several launches could (kernel nodes with programmatic dependent
// launch edges). L launches on distinct weights per graph, f16 x [1, K]; prints µs per GEMV.
// With an argument ("direct"): two plain launches per case and no graphs, for ncu:
//   ncu -k regex:GemvKernel --section WarpStateStats --section SchedulerStats ./gemv_graph_pdl direct
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -I ffi tools/probes/gemv_graph_pdl.cu \
//     ffi/kernels/gemv/inst/gemv_f16_int4_wide.cu ffi/kernels/gemv/inst/gemv_f16_int4.cu \
//     ffi/kernels/gemv/inst/gemv_f16_dense.cu -o gemv_graph_pdl
// Formats: int4 in the wide (two-piece) and one-piece n-bit formats, dense f16.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "kernels/gemv/gemv.h"
#include "kernels/gemv/plan.h"
#include "graph_chain.h"
#include "one_row.h"
#include "probe_util.h"

using joa::gemv::Fusion;
using joa::gemv::GemvParams;
using joa::gemv::Plan;

static cudaError_t Launch(const GemvParams& p, const Plan& plan, int bits, Fusion f, bool pdl, cudaStream_t s) {
  if (bits == 16) return joa::gemv::LaunchFormat<__half, 16, false>(p, plan, f, pdl, s);
  return plan.wide ? joa::gemv::LaunchFormat<__half, 4, true>(p, plan, f, pdl, s)
                   : joa::gemv::LaunchFormat<__half, 4, false>(p, plan, f, pdl, s);
}

int main(int argc, char** argv) {
  const bool direct = argc > 1;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  printf("%-32s %-5s %4s %9s %9s %9s\n", "shape", "fmt", "L", "child us", "graph us", "pdl us");
  for (const Shape& sh : kDecoderShapes) {
    if (!ProbeWants(sh)) continue;  // the ~1B shapes unless JOA_PROBE_8B says otherwise
    for (int fmt : {0, 1, 2}) {  // int4 wide, int4 one-piece, dense
      const int bits = fmt == 2 ? 16 : 4;
      const bool wide = fmt == 0;
      const int block = 32, kb = sh.k / block;
      const size_t wbytes = size_t(sh.n) * sh.k * bits / 8;
      const int L = sh.n > 100000 ? 4 : 32;  // distinct weights: together past the 50 MB L2
      const Fusion f{sh.gated, sh.norm};
      const Plan plan = joa::gemv::MakePlan(1, sh.n, sh.k, bits, sh.gated, sh.norm, true, 0, 0, wide);
      if (!plan.error.empty()) {
        printf("%s: %s\n", sh.name, plan.error.c_str());
        continue;
      }
      void *x, *gamma, *scales;
      uint8_t* zeros;
      CK(cudaMalloc(&x, sh.k * 2));
      CK(cudaMemset(x, 0, sh.k * 2));
      CK(cudaMalloc(&gamma, sh.k * 2));
      CK(cudaMemset(gamma, 0, sh.k * 2));
      const size_t meta = size_t((sh.n + 15) / 16) * kb * 16;
      CK(cudaMalloc(&scales, meta * 2 * L));
      CK(cudaMemset(scales, 0, meta * 2 * L));
      CK(cudaMalloc(&zeros, meta * L));
      CK(cudaMemset(zeros, 0, meta * L));
      std::vector<void*> ws(L), ys(L);
      std::vector<GemvParams> ps(L);
      for (int i = 0; i < L; ++i) {
        CK(cudaMalloc(&ws[i], wbytes));
        CK(cudaMemset(ws[i], 0x11, wbytes));
        CK(cudaMalloc(&ys[i], sh.n * 2));
        ps[i] = OneRowParams(x, ws[i], static_cast<char*>(scales) + meta * 2 * i, zeros + meta * i,
                             sh.norm ? gamma : nullptr, ys[i], sh.k, sh.n, sh.gated);
      }
      if (direct) {
        for (int i = 0; i < 2; ++i) CK(Launch(ps[i], plan, bits, f, false, s));
        CK(cudaStreamSynchronize(s));
        printf("%s format %d: launched\n", sh.name, fmt);
      }
      float t[3];
      // t[0]: L child graphs (as XLA records FFI calls); t[1]: one graph of L kernel nodes; t[2]:
      // the same with programmatic dependent launch edges.
      for (int mode = 0; mode < 3 && !direct; ++mode) {
        const bool pdl = mode == 2;
        CK(TimeGraphChain(L, [&](int i, cudaStream_t st) { return Launch(ps[i], plan, bits, f, pdl, st); }, mode == 0,
                          s, 100, 1, &t[mode]));
      }
      if (!direct) {
        printf("%-32s %-5s %4d %9.2f %9.2f %9.2f   (GB/s at pdl: %.0f; plan cluster %d warps_k %d grid %d)\n",
               sh.name, fmt == 0 ? "int4w" : fmt == 1 ? "int4" : "f16", L, t[0], t[1], t[2],
               wbytes / (t[2] * 1e3), plan.cluster, plan.warps_k, plan.grid);
      }
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
  }
  return 0;
}
