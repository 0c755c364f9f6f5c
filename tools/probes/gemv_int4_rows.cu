// Probe: the engine's multi-row int4 GEMV, the rows kernel (ffi/kernels/gemv/rows.cuh: y[M, N] =
// x[M, K] W^T with W in the rows layout), for M in {1, 8, 16, 32}, bs 32 and 128, f16, against a
// kernel that only reads the bytes it reads (W, scales, zero points), without jax: the layout is made
// on the device from the ONNX order (B [N, K/bs, bs/2] uint8, low nibble the even k; scales [N, K/bs]
// f16; zero points [N, K/bs] uint8 0..15), the plan is plan.h's MakeRowsPlan (or forced), the launch
// the engine's (LaunchRows). Why: the ring kernel runs at 0.12-0.5 of that floor at M = 8..32
// (bench/results/2026-12-01-gemv-ring-layouts.json).
//
// History (this probe's own kernel, sessions 13-14, now the engine's rows.cuh): it also had a
// "MODE 0" that kept A = 1024 + q exact and applied scale and zero point once per block in f32
// (acc += s C - s (1024 + z) X, X the block's sum of x); at M = 8, block 128 it lost to the
// per-weight dequantisation the engine keeps ("MODE 1") on every ~8B shape (H200, us: gate-up 27.9
// vs 22.3, down 25.3 vs 19.9, LM head 90.4 vs 80.4, o 14.6 vs 10.0, qkv 15.3 vs 10.5 at 8 warps x
// 16 K splits) and tied at block 32; 8 stages in flight lost to 4 and 2
// (/work/main/scratch/s14/int4rows/h200-sweep-s14.txt). M = 1: the slots kernel stays better. M = 32
// is issue-bound (~80 instructions a 16 bytes of W a lane).
//
// Check: a naive reference (f32 (q - z) * s * x) per output; bound |y - ref| <= 2^-11 (sum |(q - z)
// s x| + |ref|) + 1e-6: the first term is the worst case of the reference's own rounding of each
// dequantised weight to f16, the second y's rounding to f16. Exits 1 if any output exceeds it (or on
// a CUDA error).
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -diag-suppress=940,2473,128 -I ffi -I tools/probes tools/probes/gemv_int4_rows.cu \
//     -o build/gemv_int4_rows
// Run: tools/probes/run_int4_rows.sh build/gemv_int4_rows (a sweep into $OUT/int4_rows.txt).
// Env: JOA_PROBE_8B=1 adds the ~8B shapes (2: only them); JOA_PROBE_ONLY=<shape prefix>;
//   JOA_PROBE_M=1|8|16|32 (default all); JOA_PROBE_BS=32|128 (default both);
//   JOA_PROBE_DS=2|4 stages in flight a warp, JOA_PROBE_RW=1|2|4|8 warps (row groups) a CTA,
//   JOA_PROBE_S=1|2|4|8|16 cluster K split (default: planned); JOA_PROBE_CHECK=0 skips the reference.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

// The rows kernel's timeline (JOA_GEMV_MARK points in rows.cuh): CTA 0's first and last warps record
// clock64 at each mark; thread 0 of every CTA its globaltimer at start (0) and end (6). Marks: 1 the
// first W copies issued, 2 x staged, 3 the norm done and the CTA barrier passed (main loop starts),
// 4 the main loop done (every copy landed), 5 the partials written and the cluster barrier passed,
// 7 the cluster's partial sums added and stored, 6 the last cluster barrier passed (end).
#include "phase_marks.h"  // before the kernels: defines JOA_GEMV_MARK
#include "graph_chain.h"
#include "kernels/gemv/launch.cuh"  // the rows kernel and its launch
#include "probe_util.h"

JOA_GEMV_INSTANTIATE_ROWS(__half)

namespace {

using joa::gemv::kRowsGroup;
constexpr int kRowsPerGroup = kRowsGroup;

// ONNX order -> the rows layout (ffi/kernels/gemv/rows.cuh; ops.to_rows_layout does it at load). One thread per 16-byte unit of W.
__global__ void ShuffleW(const uint8_t* b, uint4* w, int n, int k, int rgs) {
  const int64_t units = int64_t(rgs) * (k / 16) * 32;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < units; u += int64_t(gridDim.x) * blockDim.x) {
    const int lane = int(u & 31), g = lane >> 2, t = lane & 3;
    const int j = int((u >> 5) % (k / 16));
    const int rg = int((u >> 5) / (k / 16));
    auto byte = [&](int r, int kk) -> uint32_t {  // nibbles of k = kk (low), kk + 1 (high)
      return r < n ? b[int64_t(r) * (k / 2) + kk / 2] : 0u;
    };
    uint32_t words[4];
    for (int i = 0; i < 4; ++i) {
      const int r0 = rg * kRowsPerGroup + 16 * i + g, r1 = r0 + 8, kk = 16 * j + 2 * t;
      const uint32_t bA = byte(r0, kk), bB = byte(r1, kk), bC = byte(r0, kk + 8), bD = byte(r1, kk + 8);
      const uint32_t nib[8] = {bA & 15, bB & 15, bC & 15, bD & 15, bA >> 4, bB >> 4, bC >> 4, bD >> 4};
      uint32_t v = 0;
      for (int q = 0; q < 8; ++q) v |= nib[q] << (4 * q);
      words[i] = v;
    }
    w[u] = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// Scales and zero points: one thread per (row group, block, g).
__global__ void ShuffleMeta(const __half* scales, const uint8_t* zeros, uint4* sc, uint2* zr, int n, int kb, int rgs) {
  const int64_t units = int64_t(rgs) * kb * 8;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < units; u += int64_t(gridDim.x) * blockDim.x) {
    const int g = int(u & 7);
    const int b = int((u >> 3) % kb);
    const int rg = int((u >> 3) / kb);
    uint16_t s[8];
    uint8_t z[8];
    for (int j = 0; j < 8; ++j) {
      const int r = rg * kRowsPerGroup + 16 * (j >> 1) + g + 8 * (j & 1);
      s[j] = r < n ? __half_as_ushort(scales[int64_t(r) * kb + b]) : 0;
      z[j] = r < n ? zeros[int64_t(r) * kb + b] : 0;
    }
    sc[u] = make_uint4(s[0] | uint32_t(s[1]) << 16, s[2] | uint32_t(s[3]) << 16, s[4] | uint32_t(s[5]) << 16,
                       s[6] | uint32_t(s[7]) << 16);
    zr[u] = make_uint2(z[0] | z[1] << 8 | z[2] << 16 | uint32_t(z[3]) << 24,
                       z[4] | z[5] << 8 | z[6] << 16 | uint32_t(z[7]) << 24);
  }
}

// Naive reference: one thread per feature n, f32 (q - z) * s * x, and sum |(q - z) s x| (the bound).
__global__ void Reference(const uint8_t* b, const __half* scales, const uint8_t* zeros, const __half* x, float* ref,
                          float* absum, int m, int n, int k, int bs) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const int kb = k / bs;
  float acc[32], ab[32];
  for (int i = 0; i < 32; ++i) acc[i] = ab[i] = 0.f;
  for (int kk = 0; kk < k; ++kk) {
    const int q = (b[int64_t(r) * (k / 2) + kk / 2] >> (4 * (kk & 1))) & 15;
    const float s = __half2float(scales[int64_t(r) * kb + kk / bs]);
    const float wv = float(q - int(zeros[int64_t(r) * kb + kk / bs])) * s;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      if (i < m) {
        const float p = wv * __half2float(x[int64_t(i) * k + kk]);
        acc[i] += p;
        ab[i] += fabsf(p);
      }
    }
  }
  for (int i = 0; i < m; ++i) {
    ref[int64_t(i) * n + r] = acc[i];
    absum[int64_t(i) * n + r] = ab[i];
  }
}

int EnvInt(const char* name, int dflt) { return getenv(name) ? atoi(getenv(name)) : dflt; }

}  // namespace

int main() {
  ProbeEnv env;
  CK(MakeProbeEnv(env));
  cudaStream_t s = env.stream;
  const int only_m = EnvInt("JOA_PROBE_M", 0), only_bs = EnvInt("JOA_PROBE_BS", 0);
  const int force_ds = EnvInt("JOA_PROBE_DS", 0);
  const int force_rw = EnvInt("JOA_PROBE_RW", 0), force_s = EnvInt("JOA_PROBE_S", 0);
  const bool check = EnvInt("JOA_PROBE_CHECK", 1) != 0;
  bool failed = false;
  printf("us a call (GB/s of W + scales + zero points): stream floor, int4 rows; frac = stream / rows;\n"
         "max|y - ref| (max|ref|, worst err / bound)\n");
  for (const Shape& sh : kDecoderShapes) {
    if (!ProbeWants(sh)) continue;
    for (int bs : {32, 128}) {
      if (only_bs && bs != only_bs) continue;
      for (int M : {1, 8, 16, 32}) {
        if (only_m && M != only_m) continue;
        const joa::gemv::Plan pl =
            joa::gemv::MakeRowsPlan(M, sh.n, sh.k, bs, false, false, true, force_s, force_rw, force_ds);
        if (!pl.error.empty()) {
          printf("%-34s M %2d bs %3d: no plan (%s)\n", sh.name, M, bs, pl.error.c_str());
          continue;
        }
        const int kb = sh.k / bs, rgs = (sh.n + kRowsPerGroup - 1) / kRowsPerGroup;
        const size_t np = size_t(rgs) * kRowsPerGroup;
        const size_t wb = np * sh.k / 2, sb = np * kb * 2, zb = np * kb, total = wb + sb + zb;
        const int L = int(std::max<size_t>(2, std::min<size_t>(64, (size_t(400) << 20) / total + 1)));  // past the L2
        // ONNX-order originals.
        uint8_t *b, *zeros;
        __half *scales, *x, *y;
        CK(cudaMalloc(&b, size_t(sh.n) * sh.k / 2));
        CK(cudaMalloc(&scales, size_t(sh.n) * kb * 2));
        CK(cudaMalloc(&zeros, size_t(sh.n) * kb));
        CK(cudaMalloc(&x, size_t(M) * sh.k * 2));
        CK(cudaMalloc(&y, size_t(M) * sh.n * 2));
        Fill<<<1024, 256>>>(b, size_t(sh.n) * sh.k / 2, 10 + M, 0xFF);
        FillHalf<<<256, 256>>>(scales, size_t(sh.n) * kb, 3, 0.001f, 0.01f);
        Fill<<<256, 256>>>(zeros, size_t(sh.n) * kb, 4, 15);
        FillHalf<<<64, 256>>>(x, size_t(M) * sh.k, 1, -1.f, 1.f);
        // L copies of [W | scales | zero points] in the probe's layout (one allocation: the stream
        // floor reads exactly the bytes the kernel reads, x aside).
        std::vector<uint8_t*> cp(L);
        std::vector<joa::gemv::GemvParams> ps(L);
        for (int i = 0; i < L; ++i) {
          CK(cudaMalloc(&cp[i], total));
          if (i == 0) {
            ShuffleW<<<1024, 256>>>(b, reinterpret_cast<uint4*>(cp[0]), sh.n, sh.k, rgs);
            ShuffleMeta<<<256, 256>>>(scales, zeros, reinterpret_cast<uint4*>(cp[0] + wb),
                                      reinterpret_cast<uint2*>(cp[0] + wb + sb), sh.n, kb, rgs);
            CK(cudaGetLastError());
          } else {
            CK(cudaMemcpy(cp[i], cp[0], total, cudaMemcpyDeviceToDevice));
          }
          joa::gemv::GemvParams& p = ps[i];
          p = joa::gemv::GemvParams{};
          p.x = x;
          p.w = cp[i];
          p.scales = cp[i] + wb;
          p.zeros = cp[i] + wb + sb;
          p.y = y;
          p.m = M, p.n_rows = p.n_out = sh.n, p.k = sh.k, p.k_blocks = kb, p.block_shift = bs == 32 ? 5 : 7;
        }
        CK(cudaDeviceSynchronize());

        auto launch = [&](int i, cudaStream_t st) {
          return joa::gemv::LaunchRows<__half>(ps[i], pl, joa::gemv::Fusion{false, false}, false, st);
        };
        float err = 0.f, rmax = 0.f, ratio = 0.f;
        if (check) {
          float *ref, *absum;
          CK(cudaMalloc(&ref, size_t(M) * sh.n * 4));
          CK(cudaMalloc(&absum, size_t(M) * sh.n * 4));
          Reference<<<(sh.n + 127) / 128, 128>>>(b, scales, zeros, x, ref, absum, M, sh.n, sh.k, bs);
          CK(cudaGetLastError());
          CK(cudaMemset(y, 0xff, size_t(M) * sh.n * 2));  // NaN: unwritten outputs fail
          CK(cudaDeviceSynchronize());  // the legacy stream's memset before the kernel on `s`
          CK(launch(0, s));
          CK(cudaStreamSynchronize(s));
          std::vector<float> hr(size_t(M) * sh.n), ha(hr.size());
          std::vector<__half> hy(hr.size());
          CK(cudaMemcpy(hr.data(), ref, hr.size() * 4, cudaMemcpyDeviceToHost));
          CK(cudaMemcpy(ha.data(), absum, ha.size() * 4, cudaMemcpyDeviceToHost));
          CK(cudaMemcpy(hy.data(), y, hy.size() * 2, cudaMemcpyDeviceToHost));
          for (size_t i = 0; i < hr.size(); ++i) {
            const float d = std::fabs(__half2float(hy[i]) - hr[i]);
            const float bound = std::ldexp(ha[i] + std::fabs(hr[i]), -11) + 1e-6f;
            rmax = std::max(rmax, std::fabs(hr[i]));
            err = std::max(err, std::isnan(d) ? 1e30f : d);
            ratio = std::max(ratio, std::isnan(d) ? 1e30f : d / bound);
          }
          if (!(ratio <= 1.f)) failed = true;
          CK(cudaFree(ref));
          CK(cudaFree(absum));
        }

        auto time = [&](auto&& launch, float* us) { return TimeGraphChain(L, launch, true, s, 30, 3, us); };
        float t_stream, t_rows;
        CK(time([&](int i, cudaStream_t st) {
          StreamKernel<<<4 * env.sms, 256, 0, st>>>(cp[i], total / 16, env.sink);
          return cudaGetLastError();
        }, &t_stream));
        CK(time(launch, &t_rows));
        // The timeline of one launch on a copy cold in L2 after the timed chain's last ones.
        CK(PrintTimeline("  timeline:", {1, 2, 3, 4, 5, 7, 6}, [&] { return launch(L > 2 ? L / 2 : 0, s); }, s));
        const double kbytes = total * 1e-3;
        printf("%-34s M %2d bs %3d DS %d RW %d S %2d grid %4d smem %6lld  stream %8.2f (%4.0f)  "
               "rows %8.2f "
               "(%4.0f)  frac %.2f  %.3g (%.3g, %.2f)%s\n",
               sh.name, M, bs, pl.stages, pl.warps_n, pl.cluster, pl.grid, (long long)pl.smem_bytes, t_stream,
               kbytes / t_stream, t_rows,
               kbytes / t_rows, t_stream / t_rows, err, rmax, ratio, check && !(ratio <= 1.f) ? "  FAIL" : "");
        fflush(stdout);
        for (int i = 0; i < L; ++i) CK(cudaFree(cp[i]));
        CK(cudaFree(b));
        CK(cudaFree(scales));
        CK(cudaFree(zeros));
        CK(cudaFree(x));
        CK(cudaFree(y));
      }
    }
  }
  return failed ? 1 : 0;
}
