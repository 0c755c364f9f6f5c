// Probe: a one-row GEMV for dense half weights W [N, K] (row-major, as the model stores them) with
// few instructions a byte, against the GEMV engine's ring kernel (kernel.cuh, DenseWeights) and a
// kernel that only reads W.
//
// Geometry: a warp owns 16-row tiles (WK warps split a tile's K). A step is 64 k of the tile's 16
// rows (2 KB): lane (g, t) loads 16 bytes of rows g/2, g/2 + 8, g/2 + 4, g/2 + 12 at k = 64 s +
// 32 (g & 1) + 8 t, so the 8 lanes with the same g/2 read 128 contiguous bytes of a row (whole L2
// lines). Those words are the A registers of two m16n8k16 MMAs as they are (no conversion): MMA row
// g holds k-slice g & 1 of its row, so B column 0 carries x's slice 0 (k 64 s + 8 t') and column 1
// slice 1 (lanes 0-7 read 128 contiguous bytes of x from shared memory, the rest zeros), and the
// row's sum is C[g][g & 1] + C[g ^ 1][g & 1 ^ 1]: lanes t = 0 of g and g ^ 1, one shuffle.
// Raw row sums (f16, no epilogue) are checked against the ring kernel for the ungated shapes.
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -diag-suppress=940,2473,128 -I ffi -I tools/probes tools/probes/gemv_dense_m1.cu \
//     ffi/kernels/gemv/inst/gemv_f16_dense.cu -o gemv_dense_m1
// Env: JOA_PROBE_8B=1 adds the ~8B shapes (2: only them); JOA_PROBE_ONLY=<shape prefix>;
// JOA_PROBE_VARIANT=<name>.
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
#include "kernels/gemv/launch.cuh"
#include "one_row.h"

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e = (x);                                                        \
    if (e != cudaSuccess) {                                                     \
      printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      return 1;                                                                 \
    }                                                                           \
  } while (0)

using namespace joa::gemv;

__global__ void FillHalfs(__half* p, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2half(lo + (hi - lo) * float(h & 0xffff) / 65536.f);
  }
}
__global__ void StreamKernel(const uint8_t* w, size_t n16, uint32_t* sink) {
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16; i += 4 * size_t(gridDim.x) * blockDim.x) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const size_t at = i + u * size_t(gridDim.x) * blockDim.x;
      v[u] = at < n16 ? LoadStream16(w4 + at) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

struct DenseStep {
  uint4 w[4];  // rows g/2 + {0, 8, 4, 12}
};

// K % (64 WK) == 0, N % 16 == 0 (host checks). Shared memory: x (K halves, normalised), 16 zero
// bytes, [2][kWarps][16] f32 partial rows, kWarps f32 norm sums.
template <int WK, int D, bool kNorm, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) DenseLeanKernel(const __grid_constant__ GemvParams p,
                                                                        __half* yraw) {
  constexpr int kTilesCta = kWarps / WK;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* s_x = reinterpret_cast<uint4*>(smem);
  const int K = p.k, units = K / 8;
  uint4* s_zero = s_x + units;
  float* s_part = reinterpret_cast<float*>(s_zero + 1);
  float* s_wsum = s_part + 2 * kWarps * 16;

  const int tid = threadIdx.x, lane = tid & 31, wk = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wt = wk / WK, kp = wk % WK;
  const int nsteps = K / 64 / WK;
  const int groups = (p.blocks + kTilesCta - 1) / kTilesCta;
  const int my_groups = (groups - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x);
  const int steps = my_groups * nsteps;
  const int64_t row_bytes = int64_t(K) * 2;
  const int64_t lane_off = int64_t(g >> 1) * row_bytes + (int64_t(kp) * nsteps * 64 + 32 * (g & 1) + 8 * t) * 2;

  int ld_step = 0, ld_j = 0, ld_it = 0;
  const uint8_t* wp = nullptr;
  auto load_next = [&](DenseStep& st) {
    if (ld_step < steps) {
      if (ld_j == 0) {
        const int tile = min((int(blockIdx.x) + ld_it * int(gridDim.x)) * kTilesCta + wt, p.blocks - 1);
        wp = static_cast<const uint8_t*>(p.w) + int64_t(tile) * 16 * row_bytes + lane_off;
      }
      st.w[0] = LoadStream16(wp);
      st.w[1] = LoadStream16(wp + 8 * row_bytes);
      st.w[2] = LoadStream16(wp + 4 * row_bytes);
      st.w[3] = LoadStream16(wp + 12 * row_bytes);
      wp += 128;
    }
    ++ld_step;
    if (++ld_j == nsteps) {
      ld_j = 0;
      ++ld_it;
    }
  };

  DenseStep buf[D];
#pragma unroll
  for (int s = 0; s < D; ++s) load_next(buf[s]);

  // x (normalised) into shared memory, natural order.
  const uint4* xg = static_cast<const uint4*>(p.x);
  float r = 0.f;
  if constexpr (kNorm) {
    float ss = 0.f;
    for (int u = tid; u < units; u += kThreads) {
      const uint4 v = xg[u];
      s_x[u] = v;
      ss = AddSquares8<__half>(v, ss);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) s_wsum[wk] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += s_wsum[w];
    r = rsqrtf(__fdiv_rn(total, float(K)) + p.eps);
    const uint4* gg = static_cast<const uint4*>(p.gamma);
    for (int u = tid; u < units; u += kThreads) s_x[u] = RmsNormInput::Apply<__half>(s_x[u], r, gg[u]);
  } else {
    for (int u = tid; u < units; u += kThreads) s_x[u] = xg[u];
  }
  if (tid == 0) *s_zero = make_uint4(0, 0, 0, 0);
  __syncthreads();

  // B: lanes 0-7 x units 8 s + lane of this warp's K part, the rest the zero unit.
  const uint4* xb = lane < 8 ? s_x + kp * nsteps * 8 + lane : s_zero;
  const int xstep = lane < 8 ? 8 : 0;

  float acc[2][2][4] = {};  // [row group (0-3 / 8-11 vs 4-7 / 12-15)][chain][C]
  int j = 0, it = 0;
  for (int i0 = 0; i0 < steps; i0 += D) {
#pragma unroll
    for (int s = 0; s < D; ++s) {
      if (i0 + s >= steps) break;
      const uint4 xv = xb[j * xstep];
      const DenseStep& st = buf[s];
#pragma unroll
      for (int rg = 0; rg < 2; ++rg) {
        const uint4& lo = st.w[2 * rg];
        const uint4& hi = st.w[2 * rg + 1];
        const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};
        const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};
        joa::ptx::Mma16816Free<__half>(acc[rg][0], a0, xv.x, xv.y);
        joa::ptx::Mma16816Free<__half>(acc[rg][1], a1, xv.z, xv.w);
      }
      load_next(buf[s]);
      if (++j < nsteps) continue;
      j = 0;
      // Row sums: lane (g, 0) takes column g & 1 of its C rows, adds lane g ^ 1's.
      float v[2][2];  // [rg][h]: rows g/2 + 4 rg + 8 h
#pragma unroll
      for (int rg = 0; rg < 2; ++rg) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float c0 = acc[rg][0][2 * h] + acc[rg][1][2 * h];
          const float c1 = acc[rg][0][2 * h + 1] + acc[rg][1][2 * h + 1];
          float x = (g & 1) ? c1 : c0;
          x += __shfl_xor_sync(0xffffffffu, x, 4);
          v[rg][h] = x;
        }
      }
#pragma unroll
      for (int rg = 0; rg < 2; ++rg)
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[rg][c][e] = 0.f;
      const int tile = (int(blockIdx.x) + it * int(gridDim.x)) * kTilesCta + wt;
      const bool writer = t == 0 && (g & 1) == 0;
      if constexpr (WK == 1) {
        if (writer && tile < p.blocks) {
#pragma unroll
          for (int rg = 0; rg < 2; ++rg)
#pragma unroll
            for (int h = 0; h < 2; ++h) yraw[tile * 16 + (g >> 1) + 4 * rg + 8 * h] = __float2half(v[rg][h]);
        }
      } else {
        float* part_s = s_part + ((it & 1) * kWarps + wk) * 16;
        if (writer) {
#pragma unroll
          for (int rg = 0; rg < 2; ++rg)
#pragma unroll
            for (int h = 0; h < 2; ++h) part_s[(g >> 1) + 4 * rg + 8 * h] = v[rg][h];
        }
        asm volatile("bar.sync %0, %1;" ::"r"(1 + wt), "r"(WK * 32) : "memory");
        if (kp == 0 && lane < 16 && tile < p.blocks) {
          float sum = 0.f;
#pragma unroll
          for (int w = 0; w < WK; ++w) sum += part_s[w * 16 + lane];
          yraw[tile * 16 + lane] = __float2half(sum);
        }
      }
      ++it;
    }
  }
}

struct Variant {
  const char* name;
  int wk, min_blocks;
  void (*fn[2])(GemvParams, __half*);  // [norm]
};
#define JOA_DENSE(wk, d, mb) \
  { "wk" #wk "-d" #d "-b" #mb, wk, mb, {DenseLeanKernel<wk, d, false, mb>, DenseLeanKernel<wk, d, true, mb>} }
static const Variant kVariants[] = {
    JOA_DENSE(1, 2, 2), JOA_DENSE(2, 2, 2), JOA_DENSE(4, 2, 2), JOA_DENSE(8, 2, 2),
    JOA_DENSE(1, 3, 2), JOA_DENSE(2, 3, 2), JOA_DENSE(4, 3, 2), JOA_DENSE(8, 3, 2),
    JOA_DENSE(1, 2, 3), JOA_DENSE(2, 2, 3), JOA_DENSE(4, 2, 3), JOA_DENSE(8, 2, 3),
    JOA_DENSE(1, 4, 2), JOA_DENSE(4, 4, 2),
};

struct Shape {
  const char* name;
  int k, n;
  bool norm, gated;
};

int main() {
  const Shape shapes[] = {{"o 2048x2048", 2048, 2048, false, false},
                          {"qkv 2048x3072 +norm", 2048, 3072, true, false},
                          {"gate-up 2048x16384 +norm gated", 2048, 16384, true, true},
                          {"down 8192x2048", 8192, 2048, false, false},
                          {"lm 2048x128256 +norm", 2048, 128256, true, false},
                          {"8b-o 4096x4096", 4096, 4096, false, false},
                          {"8b-qkv 4096x6144 +norm", 4096, 6144, true, false},
                          {"8b-gate-up 4096x28672 +norm gated", 4096, 28672, true, true},
                          {"8b-down 14336x4096", 14336, 4096, false, false},
                          {"8b-lm 4096x128256 +norm", 4096, 128256, true, false}};
  const int with_8b = getenv("JOA_PROBE_8B") ? atoi(getenv("JOA_PROBE_8B")) : 0;
  const char* only = getenv("JOA_PROBE_ONLY");
  const char* only_v = getenv("JOA_PROBE_VARIANT");
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint32_t* sink;
  CK(cudaMalloc(&sink, 16));
  printf("us a call (chains of launches on distinct weights, CUDA graph); GB/s of W; err = max|lean - ring| (max|ring|)\n");
  for (const Shape& sh : shapes) {
    const bool is_8b = sh.name[0] == '8';
    if (is_8b ? with_8b == 0 : with_8b == 2) continue;
    if (only != nullptr && std::string(sh.name).rfind(only, 0) != 0) continue;
    const size_t wbytes = size_t(sh.n) * sh.k * 2;
    const int L = std::max<int>(2, std::min<size_t>(24, (size_t(400) << 20) / wbytes + 1));
    const Fusion f{sh.gated, sh.norm};
    const Plan ring = MakePlan(1, sh.n, sh.k, 16, sh.gated, sh.norm, true);
    if (!ring.error.empty()) {
      printf("%s: no ring plan (%s)\n", sh.name, ring.error.c_str());
      continue;
    }
    __half *x, *gamma;
    CK(cudaMalloc(&x, sh.k * 2));
    FillHalfs<<<64, 256>>>(x, sh.k, 1, -1.f, 1.f);
    CK(cudaMalloc(&gamma, sh.k * 2));
    FillHalfs<<<64, 256>>>(gamma, sh.k, 2, 0.5f, 1.5f);
    std::vector<__half*> ws(L), ys(L), yraws(L);
    std::vector<GemvParams> ps(L);
    for (int i = 0; i < L; ++i) {
      CK(cudaMalloc(&ws[i], wbytes));
      FillHalfs<<<1024, 256>>>(ws[i], wbytes / 2, 10 + i, -0.05f, 0.05f);
      CK(cudaMalloc(&ys[i], size_t(sh.n) * 2));
      CK(cudaMalloc(&yraws[i], size_t(sh.n) * 2));
      ps[i] = OneRowParams(x, ws[i], nullptr, nullptr, sh.norm ? gamma : nullptr, ys[i], sh.k, sh.n, sh.gated);
      ps[i].k_blocks = 0;
      ps[i].block_shift = 0;
    }
    CK(cudaDeviceSynchronize());
    float t_stream, t_ring;
    CK((TimeGraphChain(L, [&](int i, cudaStream_t st) {
      StreamKernel<<<4 * sms, kThreads, 0, st>>>(reinterpret_cast<const uint8_t*>(ws[i]), wbytes / 16, sink);
      return cudaGetLastError(); }, true, s, 50, 3, &t_stream)));
    CK((TimeGraphChain(L, [&](int i, cudaStream_t st) { return LaunchFormat<__half, 16, false>(ps[i], ring, f, false, st); },
                       true, s, 50, 3, &t_ring)));
    std::vector<__half> y_ring(sh.n), y_lean(sh.n);
    if (!sh.gated) {
      CK((LaunchFormat<__half, 16, false>(ps[0], ring, f, false, s)));
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(y_ring.data(), ys[0], sh.n * 2, cudaMemcpyDeviceToHost));
    }
    const double gb = wbytes * 1e-3;
    printf("%-34s stream %7.2f (%4.0f)  ring %7.2f (%4.0f)  L %d\n", sh.name, t_stream, gb / t_stream, t_ring,
           gb / t_ring, L);
    for (const Variant& v : kVariants) {
      if (only_v != nullptr && std::string(v.name) != only_v) continue;
      if (sh.k % (64 * v.wk) != 0) continue;
      const int smem = sh.k * 2 + 16 + 2 * kWarps * 16 * 4 + kWarps * 4;
      auto fn = v.fn[sh.norm ? 1 : 0];
      CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const int blocks = sh.n / 16;
      const int groups = (blocks + kWarps / v.wk - 1) / (kWarps / v.wk);
      const int grid = std::min(groups, v.min_blocks * sms);
      auto launch = [&](int i, cudaStream_t st) {
        GemvParams q = ps[i];
        q.blocks = blocks;
        fn<<<grid, kThreads, smem, st>>>(q, yraws[i]);
        return cudaGetLastError();
      };
      float err = 0.f, ymax = 0.f;
      if (!sh.gated) {
        CK(cudaMemset(yraws[0], 0xff, sh.n * 2));
        CK(launch(0, s));
        CK(cudaStreamSynchronize(s));
        CK(cudaMemcpy(y_lean.data(), yraws[0], sh.n * 2, cudaMemcpyDeviceToHost));
        for (int r = 0; r < sh.n; ++r) {
          ymax = std::max(ymax, std::fabs(__half2float(y_ring[r])));
          const float d = std::fabs(__half2float(y_lean[r]) - __half2float(y_ring[r]));
          err = std::max(err, std::isnan(d) ? 1e30f : d);
        }
      }
      float tv;
      CK(TimeGraphChain(L, launch, true, s, 50, 3, &tv));
      printf("    %-12s %7.2f (%4.0f)  %.2fx ring  %.2fx stream  grid %d  err %.4g (%.4g)\n", v.name, tv, gb / tv,
             t_ring / tv, t_stream / tv, grid, err, ymax);
    }
    fflush(stdout);
    for (int i = 0; i < L; ++i) {
      cudaFree(ws[i]);
      cudaFree(ys[i]);
      cudaFree(yraws[i]);
    }
    cudaFree(x);
    cudaFree(gamma);
  }
  return 0;
}
