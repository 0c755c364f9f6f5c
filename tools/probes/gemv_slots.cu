// Probe: the GEMV engine's slots kernel (ffi/kernels/gemv/slots.cuh: one row of x, 4-bit wide
// weights) against its ring kernel on a ~1B decoder's projections, f16, block 32, zero points;
// chains of L launches on distinct weights in a CUDA graph (each launch its own child graph, as
// XLA records FFI calls), with two floors: a kernel that does nothing and one that only reads W.
// Checks that slots and ring agree within f16 rounding, and prints the slots kernel's timeline
// (clock64 at its JOA_GEMV_MARK points in CTA 0; CTA start / end spread from %globaltimer).
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -diag-suppress=940,2473 -I ffi tools/probes/gemv_slots.cu ffi/kernels/gemv/inst/gemv_f16_int4_wide.cu \
//     -o gemv_slots
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

// The slots kernel's timeline (phase_marks.h; marks 4 and 5 repeat per chunk / tile).
// Marks: 1 W requested, 2 x landed, 3 x staged, 4 a chunk done, 5 a tile's epilogue done, 6 end,
// 7 the cluster's barrier handshake done (before W is requested).
#include "phase_marks.h"  // before the kernels: defines JOA_GEMV_MARK

// Every CTA reading its own copy of x and gamma (the cost of all reading one vector from L2): build
// both files with `-include xcopy.h`, a header that defines stage.cuh's hook as
//   #define JOA_GEMV_X_COPY(ptr, n) (static_cast<const __half*>(ptr) == nullptr ? nullptr \
//                                    : static_cast<const __half*>(ptr) + size_t(blockIdx.x) * (n))
// (the ring kernel is compiled in the inst file; nvcc's -D does not take this macro). x and gamma
// are allocated kCopies times, all copies equal.
// The ring kernel's x copies in one order for every CTA (before the per-CTA rotation, stage.cuh's
// XRotation): both files with `-include` a header holding `#define JOA_GEMV_X_ROTATE 0`.
constexpr int kCopies = 512;  // >= any grid here

#include "kernels/gemv/gemv.h"
#include "kernels/gemv/launch.cuh"  // LaunchSlotsKernel, ApplyPlan (the slots kernel instantiated here, with the marks)
#include "graph_chain.h"
#include "one_row.h"
#include "probe_util.h"

using namespace joa::gemv;

__global__ void NullKernel(GemvParams p) {
  if (threadIdx.x == 1000) static_cast<__half*>(p.y)[0] = __float2half(0.f);
}
enum Variant { kNull, kStream, kRing, kSlots };
const char* const kNames[] = {"null", "stream", "ring", "slots"};

static cudaError_t Launch(Variant v, GemvParams p, const Plan& ring, const Plan& slots, Fusion f, cudaStream_t s) {
  switch (v) {
    case kNull: NullKernel<<<ring.grid, kThreads, 0, s>>>(p); return cudaGetLastError();
    case kStream:
      StreamKernel<<<4 * kPlanSms, kThreads, 0, s>>>(p.w, size_t(p.n_rows) * p.k / 32, static_cast<uint32_t*>(p.y));
      return cudaGetLastError();
    case kRing: return LaunchFormat<__half, 4, true>(p, ring, f, false, s);
    default:
      ApplyPlan(p, slots, false);
      return WithPolicies(f, [&](auto pol) {
        using P = decltype(pol);
        return LaunchSlotsKernel<__half, SlotFormat<__half>, typename P::Prologue, typename P::Epilogue>(p, slots, false, s);
      });
  }
}

int main() {
  // JOA_PROBE_M=8: x of 8 rows, the ring kernel only (the slots kernel takes one row).
  const int M = getenv("JOA_PROBE_M") ? atoi(getenv("JOA_PROBE_M")) : 1;
  // JOA_PROBE_CLUSTER / JOA_PROBE_WARPS_K: force the ring kernel's plan (0: planned).
  const int force_cluster = getenv("JOA_PROBE_CLUSTER") ? atoi(getenv("JOA_PROBE_CLUSTER")) : 0;
  const int force_warps_k = getenv("JOA_PROBE_WARPS_K") ? atoi(getenv("JOA_PROBE_WARPS_K")) : 0;
  const int block = 32;  // one_row.h's metadata
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  printf("%-32s %8s %8s %8s %8s   max|slots-ring| (max|ring|)\n", "shape (us a call)", "null", "stream", "ring",
         "slots");
  for (const Shape& sh : kDecoderShapes) {
    if (!ProbeWants(sh)) continue;
    const int kb = sh.k / block;
    const size_t wbytes = size_t(sh.n) * sh.k / 2;
    const int L = sh.n > 100000 ? 4 : 24;  // distinct weights: together past the 50 MB L2
    const Fusion f{sh.gated, sh.norm};
    const Plan ring = MakePlan(M, sh.n, sh.k, 4, sh.gated, sh.norm, true, force_cluster, force_warps_k, true, block, false);
    const Plan slots = MakePlan(1, sh.n, sh.k, 4, sh.gated, sh.norm, true, 0, 0, true, block, true);
    if (!ring.error.empty() || (M == 1 && !slots.slots)) {
      printf("%s: no plan (%s)\n", sh.name, ring.error.c_str());
      continue;
    }
    __half *x, *gamma, *scales;
    uint8_t* zeros;
    const size_t xn = size_t(M) * sh.k;
    CK(cudaMalloc(&x, xn * 2 * kCopies));
    FillHalf<<<64, 256>>>(x, xn, 1, -1.f, 1.f);
    CK(cudaMalloc(&gamma, sh.k * 2 * kCopies));
    FillHalf<<<64, 256>>>(gamma, sh.k, 2, 0.5f, 1.5f);
    for (int c = 1; c < kCopies; ++c) {
      CK(cudaMemcpy(x + c * xn, x, xn * 2, cudaMemcpyDeviceToDevice));
      CK(cudaMemcpy(gamma + c * size_t(sh.k), gamma, sh.k * 2, cudaMemcpyDeviceToDevice));
    }
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
      CK(cudaMalloc(&ys[i], size_t(M) * sh.n * 2));
      ps[i] = OneRowParams(x, ws[i], scales + meta * i, zeros + meta * i, sh.norm ? gamma : nullptr, ys[i], sh.k,
                           sh.n, sh.gated);
      ps[i].m = M;
    }
    CK(cudaDeviceSynchronize());
    const int n_out = ps[0].n_out;
    float ymax = 0.f, worst = 0.f;
    if (M == 1) {  // slots vs ring, and the slots kernel's timeline
      std::vector<__half> y_ring(n_out), y_slots(n_out);
      CK(Launch(kRing, ps[0], ring, slots, f, s));
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(y_ring.data(), ys[0], n_out * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemset(ys[0], 0xff, n_out * 2));
      CK(Launch(kSlots, ps[0], ring, slots, f, s));
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(y_slots.data(), ys[0], n_out * 2, cudaMemcpyDeviceToHost));
      for (int i = 0; i < n_out; ++i) {
        ymax = std::max(ymax, std::fabs(__half2float(y_ring[i])));
        const float d = std::fabs(__half2float(y_slots[i]) - __half2float(y_ring[i]));
        worst = std::max(worst, std::isnan(d) ? 1e30f : d);
      }
      {  // the slots kernel's timeline on weight 1 (not in L2 from the check)
        char label[96];
        snprintf(label, sizeof label, "  slots timeline (grid %d, cluster %d),", slots.grid, slots.cluster);
        CK(PrintTimeline(label, {1, 2, 3, 4, 5, 6, 7}, [&] { return Launch(kSlots, ps[1], ring, slots, f, s); }, s));
      }
    }
    printf("%-32s", sh.name);
    for (Variant v : {kNull, kStream, kRing, kSlots}) {
      if (v == kSlots && M != 1) {
        printf(" %8s", "-");
        continue;
      }
      float t;
      CK(TimeGraphChain(L, [&](int i, cudaStream_t st) { return Launch(v, ps[i], ring, slots, f, st); }, true, s, 50, 3,
                        &t));
      printf(" %8.2f", t);
    }
    printf("   %.4g (%.4g)  ring: cluster %d warps_k %d grid %d\n", worst, ymax, ring.cluster, ring.warps_k, ring.grid);
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
  (void)kNames;
  return 0;
}
