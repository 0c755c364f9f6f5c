// Probe: the gated MLP of one decode row as one cooperative kernel (ffi/kernels/gemv/mlp_row.cuh)
// against today's two dense row GEMVs (gate-up with the norm and the gated SiLU, then down with the
// residual), each launch its own child graph as XLA records FFI calls; L layers on distinct weights
// (past the L2). Prints µs a layer, the bytes' rate, and max |fused - two kernels| (max |y|).
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -diag-suppress=940,2473,128 -I ffi -I tools/probes tools/probes/mlp_row.cu \
//     ffi/kernels/gemv/inst/gemv_f16_dense.cu -o mlp_row
// Also the N-split variant (its kernel lives here until it is measured): h to global, one grid
// barrier, then whole rows of y a CTA (no partials), the down tiles' first W in flight across it.
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
#include "kernels/gemv/gemv.h"
#include "kernels/gemv/mlp_row.cuh"
#include "kernels/gemv/plan.h"
#include "one_row.h"
#include "probe_util.h"

namespace joa::gemv {
// The N-split variant: CTA c writes its h slice to `hidden` (global, I of T); after a grid barrier
// every CTA computes whole rows of y: the down tiles c, c + G, ... over all of K (warp w its K
// range, as the gate-up tiles), so no partial sums and no second barrier. The down tiles' first
// kDepth steps of W are in flight before the barrier (they do not depend on h).
template <int kW>
struct MlpRowNSmem {
  __host__ __device__ static int HOffset(int h) { return h * 2; }
  __host__ __device__ static int ZeroOffset(int h, int inter) { return h * 2 + inter * 2; }
  __host__ __device__ static int RedOffset(int h, int inter) { return ZeroOffset(h, inter) + 16; }
  __host__ __device__ static int Bytes(int h, int inter) { return RedOffset(h, inter) + (2 * kW * 16 + kW) * 4; }
};

template <int kW>
inline bool MlpRowNFits(int h, int inter, int grid) {
  if (h % (64 * kW) != 0 || inter % (64 * kW) != 0 || grid <= 0) return false;
  return (inter / 8) % grid == 0;
}

template <typename T, int kW, int kDepth, bool kNorm>
__global__ void __launch_bounds__(kW * 32, 1) MlpRowNKernel(const __grid_constant__ MlpRowParams p) {
  constexpr int kThreadsW = kW * 32;
  using Smem = MlpRowNSmem<kW>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tiles = p.tiles_per_cta, hc = 8 * tiles;
  uint4* s_x = reinterpret_cast<uint4*>(smem);
  uint4* s_h = reinterpret_cast<uint4*>(smem + Smem::HOffset(p.h));
  uint4* s_zero = reinterpret_cast<uint4*>(smem + Smem::ZeroOffset(p.h, p.inter));
  float* s_red = reinterpret_cast<float*>(smem + Smem::RedOffset(p.h, p.inter));
  float* s_wsum = s_red + 2 * kW * 16;
  T* hidden = reinterpret_cast<T*>(p.partials);

  const int tid = threadIdx.x, lane = tid & 31, wk = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int cta = int(blockIdx.x), grid = int(gridDim.x);
  const int nsteps_a = p.h / (64 * kW);
  const int steps_a = tiles * nsteps_a;
  const int nsteps_b = p.inter / (64 * kW);
  const int tiles_b = (p.h / 16 - cta + grid - 1) / grid;
  const int steps = steps_a + tiles_b * nsteps_b;
  const int64_t row_a = int64_t(p.h) * 2, row_b = int64_t(p.inter) * 2;
  const int64_t lane_a = int64_t(g >> 1) * row_a + (int64_t(wk) * nsteps_a * 64 + 32 * (g & 1) + 8 * t) * 2;
  const int64_t lane_b = int64_t(g >> 1) * row_b + (int64_t(wk) * nsteps_b * 64 + 32 * (g & 1) + 8 * t) * 2;
  const uint8_t* w_gu = static_cast<const uint8_t*>(p.w_gu) + int64_t(cta) * tiles * 16 * row_a + lane_a;
  const uint8_t* w_dn = static_cast<const uint8_t*>(p.w_down) + int64_t(cta) * 16 * row_b + lane_b;

  int ld = 0, ld_j = 0;
  const uint8_t* wp = w_gu;
  int64_t stride = row_a;
  auto load_next = [&](DenseRowStep& st) {
    if (ld < steps) {
      DenseRowLoad(st, wp, stride);
      wp += 128;
    }
    ++ld;
    if (ld <= steps_a) {
      if (++ld_j == nsteps_a) {
        ld_j = 0;
        wp += 16 * row_a - nsteps_a * 128;
      }
      if (ld == steps_a) {
        wp = w_dn;
        stride = row_b;
      }
    } else if (++ld_j == nsteps_b) {  // this CTA's next down tile
      ld_j = 0;
      wp += int64_t(grid) * 16 * row_b - nsteps_b * 128;
    }
  };
  DenseRowStep buf[kDepth];
#pragma unroll
  for (int s = 0; s < kDepth; ++s) load_next(buf[s]);

  const int units = p.h / 8;
  const uint4* xg = static_cast<const uint4*>(p.x);
  if constexpr (kNorm) {
    float ss = 0.f;
    for (int u = tid; u < units; u += kThreadsW) {
      const uint4 v = LoadInput16(xg + u);
      s_x[u] = v;
      ss = AddSquares8<T>(v, ss);
    }
    const float r = OneRowInverseRms<kW>(ss, s_wsum, lane, wk, p.h, p.eps);
    const uint4* gamma = static_cast<const uint4*>(p.gamma);
    for (int u = tid; u < units; u += kThreadsW) s_x[u] = RmsNormInput::Apply<T>(s_x[u], r, LoadInput16(gamma + u));
  } else {
    for (int u = tid; u < units; u += kThreadsW) s_x[u] = LoadInput16(xg + u);
  }
  if (tid == 0) *s_zero = make_uint4(0, 0, 0, 0);
  __syncthreads();

  const uint4* xb = lane < 8 ? s_x + wk * nsteps_a * 8 + lane : s_zero;
  const uint4* hb = lane < 8 ? s_h + wk * nsteps_b * 8 + lane : s_zero;
  const int xstep = lane < 8 ? 8 : 0;

  float acc[2][2][4] = {};
  int j = 0, it = 0;
  for (int i0 = 0; i0 < steps; i0 += kDepth) {
#pragma unroll
    for (int s = 0; s < kDepth; ++s) {
      const int i = i0 + s;
      if (i >= steps) break;
      const bool gate_up = i < steps_a;
      if (i == steps_a) {
        // Every CTA's h written: stage all of it (I of T) while the down tiles' W is in flight.
        cooperative_groups::this_grid().sync();
        const uint4* hg = reinterpret_cast<const uint4*>(hidden);
        for (int u = tid; u < p.inter / 8; u += kThreadsW) s_h[u] = __ldcg(hg + u);
        __syncthreads();
      }
      DenseRowMma<T>(acc, buf[s], gate_up ? xb[j * xstep] : hb[j * xstep]);
      load_next(buf[s]);
      if (++j < (gate_up ? nsteps_a : nsteps_b)) continue;
      j = 0;
      float* red = s_red + (it & 1) * kW * 16;
      DenseRowTileSums(acc, g, t, [&](int r, float v) { red[wk * 16 + r] = v; });
      __syncthreads();
      if (gate_up) {
        if (tid < 8) {
          float vg = 0.f, vu = 0.f;
#pragma unroll
          for (int w = 0; w < kW; ++w) {
            vg += red[w * 16 + tid];
            vu += red[w * 16 + 8 + tid];
          }
          const float gr = ToFloat(FromFloat<T>(vg));
          const float ur = ToFloat(FromFloat<T>(vu));
          hidden[int64_t(cta) * hc + it * 8 + tid] = FromFloat<T>(__fmul_rn(__fdiv_rn(gr, 1.f + expf(-gr)), ur));
        }
        ++it;
      } else if (tid < 16) {  // output row tid of the down tile, warps in order
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < kW; ++w) v += red[w * 16 + tid];
        const int row = (cta + (it - tiles) * grid) * 16 + tid;
        T out = FromFloat<T>(v);
        if (p.residual != nullptr) out = FromFloat<T>(ToFloat(out) + ToFloat(static_cast<const T*>(p.residual)[row]));
        static_cast<T*>(p.y)[row] = out;
        ++it;
      } else {
        ++it;
      }
    }
  }
}

}  // namespace joa::gemv

using namespace joa::gemv;

template <int kW, int kDepth>
cudaError_t LaunchMlp(const MlpRowParams& p, int grid, cudaStream_t s) {
  const int smem = MlpRowSmem<kW>::Bytes(p.h, p.tiles_per_cta);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kW * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, MlpRowKernel<__half, kW, kDepth, true>, p);
}

template <int kW, int kDepth>
cudaError_t LaunchMlpN(const MlpRowParams& p, int grid, cudaStream_t s) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kW * 32);
  cfg.dynamicSmemBytes = MlpRowNSmem<kW>::Bytes(p.h, p.inter);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, MlpRowNKernel<__half, kW, kDepth, true>, p);
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
    // The N-split variant: its own grid (the most CTAs <= SMs dividing I / 8, H / 16 too if it can).
    int grid_n = 0;
    for (int pass = 0; pass < 2 && grid_n == 0; ++pass) {
      for (int gr = env.sms; gr > 0; --gr) {
        if (MlpRowNFits<8>(H, I, gr) && MlpRowNFits<16>(H, I, gr) && (pass == 1 || (H / 16) % gr == 0)) {
          grid_n = gr;
          break;
        }
      }
    }
    printf("  N-split grid %d\n", grid_n);
    for (auto& f : pf) f.tiles_per_cta = I / 8 / grid_n;
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
