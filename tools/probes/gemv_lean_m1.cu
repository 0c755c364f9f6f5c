// Probe: what the one-row 4-bit GEMV (ffi/kernels/gemv/slots.cuh) could run at with less work per
// chunk. Same math as the slots kernel (MMA slots, x staged by SlotsStageIssue / Finish), three
// things changed:
//   - addresses by pointer increments from a per-tile base (the slots kernel recomputes 64-bit
//     addresses and validity for each of a chunk's 12 loads);
//   - WK warps per 16-row tile (WK = 1: a warp owns whole tiles, no CTA barrier per tile; the
//     slots kernel always splits K over the CTA's 8 warps and syncs the CTA every tile);
//   - layout "rec" (optional): W and the lane's scales / zero points in one record per
//     (tile, 256-k chunk), 2048 B of W in lane order + 384 B of metadata (3 coalesced words a lane),
//     converted from the wide format here; layout "wide": the wide format as it is.
// Raw row sums (no epilogue) are checked against the ring kernel for the ungated shapes.
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -diag-suppress=940,2473,128 -I ffi -I tools/probes tools/probes/gemv_lean_m1.cu \
//     ffi/kernels/gemv/inst/gemv_f16_int4_wide.cu -o gemv_lean_m1
// Env: JOA_PROBE_8B=1 adds the ~8B shapes (2: only them); JOA_PROBE_ONLY=<shape prefix>;
// JOA_PROBE_VARIANT=<name> one lean variant only (for ncu).
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
#include "probe_util.h"

using namespace joa::gemv;

constexpr int kRecW = 2048, kRecMeta = 384, kRecBytes = kRecW + kRecMeta;

// Record (tile, c): word j (h = j >> 1, piece j & 1) of lane L at j * 512 + 16 L; metadata word m
// of lane L at 2048 + 128 m + 4 L: m 0 / 1 scales (e 0, 1) of row g + 8 m as half2, m 2 the four
// zero points (byte 2 h + e).
__global__ void ToRecords(GemvParams p, uint8_t* rec) {
  const int kc = p.k / 256;
  const int64_t n_rec = int64_t(p.n_rows / 16) * kc;
  const int64_t row_bytes = p.k / 2;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n_rec * 32; i += int64_t(gridDim.x) * blockDim.x) {
    const int lane = int(i & 31), g = lane >> 2, t = lane & 3;
    const int64_t r = i >> 5;
    const int tile = int(r / kc), c = int(r % kc);
    uint8_t* dst = rec + r * kRecBytes;
    for (int j = 0; j < 4; ++j) {
      const int h = j >> 1, pc = j & 1;
      const uint8_t* src = static_cast<const uint8_t*>(p.w) + int64_t(tile * 16 + g + 8 * h) * row_bytes +
                           (c * 256 + 32 * t) / 2 + 64 * pc;
      *reinterpret_cast<uint4*>(dst + j * 512 + 16 * lane) = *reinterpret_cast<const uint4*>(src);
    }
    uint32_t zw = 0;
    for (int h = 0; h < 2; ++h) {
      unsigned short sc[2];
      for (int e = 0; e < 2; ++e) {
        const int b = (c * 256 + SlotFormat<__half>::SlotK(2 * t + e)) >> p.block_shift;
        const int64_t at = (int64_t(tile) * p.k_blocks + b) * 16 + g + 8 * h;
        sc[e] = static_cast<const unsigned short*>(p.scales)[at];
        zw |= uint32_t(p.zeros[at]) << (8 * (2 * h + e));
      }
      *reinterpret_cast<uint32_t*>(dst + kRecW + 128 * h + 4 * lane) = uint32_t(sc[0]) | (uint32_t(sc[1]) << 16);
    }
    *reinterpret_cast<uint32_t*>(dst + kRecW + 256 + 4 * lane) = zw;
  }
}

struct LeanChunk {
  uint4 w[2][2];   // [h][piece]
  uint32_t sc[2];  // [h]: half2 (e 0, e 1)
  uint32_t zw;     // byte 2 h + e
};

// Layout wide: scales / zeros of (row g + 8 h, slot 2 t + e) at meta_base + c * (256 >> shift) * 16
// + soff[e] + 8 h. Needs K % 256 == 0 and n_rows % 16 == 0 (checked on the host).
template <bool kRec, int WK, int D, class Prologue>
__global__ void __launch_bounds__(kThreads, 2) LeanKernel(const __grid_constant__ GemvParams p, const uint8_t* rec,
                                                           __half* yraw) {
  using F = SlotFormat<__half>;
  constexpr int kTilesCta = kWarps / WK;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* s_x = smem;
  float* s_red = reinterpret_cast<float*>(smem + p.x_bytes);
  unsigned char* s_zero = smem + p.ring_offset;
  float2* s_piece = reinterpret_cast<float2*>(s_zero + 512);
  float* s_part = reinterpret_cast<float*>(smem + SlotsSmemBytes(p, Prologue::kNorm));  // [2][kWarps][16]

  const int tid = threadIdx.x, lane = tid & 31, wk = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wt = wk / WK, kp = wk % WK;
  const int cpp = (p.kc + WK - 1) / WK;
  const int c0 = kp * cpp, nch = max(0, min(p.kc, c0 + cpp) - c0);
  const int groups = (p.blocks + kTilesCta - 1) / kTilesCta;
  const int my_groups = (groups - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x);
  const int steps = my_groups * nch;

  // Per-tile bases (recomputed when the load cursor enters a tile).
  const int64_t row_bytes = p.k / 2;
  const int blocks_per_chunk_x16 = (256 >> p.block_shift) * 16;
  int soff[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) soff[e] = (F::SlotK(2 * t + e) >> p.block_shift) * 16 + g;

  int ld_step = 0, ld_j = 0, ld_it = 0;
  const uint8_t* wt_base = nullptr;
  const unsigned short* st_base = nullptr;
  const uint8_t* zt_base = nullptr;
  const uint8_t* rt_base = nullptr;
  auto enter_tile = [&](int it) {
    const int tile = (int(blockIdx.x) + it * int(gridDim.x)) * kTilesCta + wt;
    const int tl = min(tile, p.blocks - 1);  // past the end: loads of the last tile, never stored
    if constexpr (kRec) {
      rt_base = rec + (int64_t(tl) * p.kc + c0) * kRecBytes + 16 * lane;
    } else {
      wt_base = static_cast<const uint8_t*>(p.w) + int64_t(tl * 16 + g) * row_bytes + 16 * t + c0 * 128;
      const int64_t m0 = int64_t(tl) * p.k_blocks * 16 + int64_t(c0) * blocks_per_chunk_x16;
      st_base = static_cast<const unsigned short*>(p.scales) + m0;
      zt_base = p.zeros + m0;
    }
  };
  auto load_next = [&](LeanChunk& ch) {
    if (ld_step < steps) {
      if (ld_j == 0) enter_tile(ld_it);
      if constexpr (kRec) {
        const uint8_t* r = rt_base + int64_t(ld_j) * kRecBytes;
#pragma unroll
        for (int j = 0; j < 4; ++j) ch.w[j >> 1][j & 1] = LoadStream16(r + 512 * j);
        const uint8_t* m = r - 12 * lane + kRecW;  // word m of lane L at 128 m + 4 L
        ch.sc[0] = __ldg(reinterpret_cast<const uint32_t*>(m));
        ch.sc[1] = __ldg(reinterpret_cast<const uint32_t*>(m + 128));
        ch.zw = __ldg(reinterpret_cast<const uint32_t*>(m + 256));
      } else {
        const uint8_t* src = wt_base + ld_j * 128;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int pc = 0; pc < 2; ++pc) ch.w[h][pc] = LoadStream16(src + 8 * row_bytes * h + 64 * pc);
        const int mo = ld_j * blocks_per_chunk_x16;
        uint32_t s[2][2], z = 0;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            s[h][e] = __ldg(st_base + mo + soff[e] + 8 * h);
            z |= uint32_t(__ldg(zt_base + mo + soff[e] + 8 * h)) << (8 * (2 * h + e));
          }
        ch.sc[0] = s[0][0] | (s[0][1] << 16);
        ch.sc[1] = s[1][0] | (s[1][1] << 16);
        ch.zw = z;
      }
    }
    ++ld_step;
    if (++ld_j == nch) {
      ld_j = 0;
      ++ld_it;
    }
  };

  SlotsStageIssue<__half, Prologue>(p, smem, tid);
  LeanChunk buf[D];
#pragma unroll
  for (int s = 0; s < D; ++s) load_next(buf[s]);
  for (int i = tid; i < 512 / 16; i += kThreads) reinterpret_cast<uint4*>(s_zero)[i] = make_uint4(0, 0, 0, 0);
  SlotsStageFinish<__half, Prologue>(p, smem, s_red, s_piece, tid, nullptr, nullptr);
  __syncthreads();

  const unsigned char* x_base[2];
  int x_step[2];
#pragma unroll
  for (int pc = 0; pc < 2; ++pc) {
    const bool mine = g == 4 * pc + t;
    x_base[pc] = (mine ? s_x : s_zero) + 16 * t + (mine ? c0 * F::kF.quads * 64 : 0);
    x_step[pc] = mine ? F::kF.quads * 64 : 0;
  }
  const float2* piece_base = s_piece + ((c0 * 256) >> 5);

  float tot[2] = {0.f, 0.f};
  int j = 0, it = 0;
  for (int i0 = 0; i0 < steps; i0 += D) {
#pragma unroll
    for (int s = 0; s < D; ++s) {
      if (i0 + s >= steps) break;
      float part[2][4] = {};
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        uint32_t a[2][4];
        const uint4& w4 = buf[s].w[0][q >> 2];
        const uint4& v4 = buf[s].w[1][q >> 2];
        const int word = q & 3;
        const uint32_t vw[2] = {word == 0 ? w4.x : word == 1 ? w4.y : word == 2 ? w4.z : w4.w,
                                word == 0 ? v4.x : word == 1 ? v4.y : word == 2 ? v4.z : v4.w};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t v = vw[h], v8 = v >> 8;
          a[0][h] = AndOr(v, 0x000F000Fu, 0x64006400u);
          a[0][2 + h] = AndOr(v, 0x00F000F0u, 0x64006400u);
          a[1][h] = AndOr(v8, 0x000F000Fu, 0x64006400u);
          a[1][2 + h] = AndOr(v8, 0x00F000F0u, 0x64006400u);
        }
        const int pc = q >> 2;
        const uint4 xv = *reinterpret_cast<const uint4*>(x_base[pc] + j * x_step[pc] + 64 * (q & 3) + 256 * pc);
        joa::ptx::Mma16816Free<__half>(part[q & 1], a[0], xv.x, xv.y);
        joa::ptx::Mma16816Free<__half>(part[q & 1], a[1], xv.z, xv.w);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float2 blk = piece_base[((j * 256) >> 5) + (F::SlotK(2 * t + e) >> 5)];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float scale = __half2float(__ushort_as_half(static_cast<unsigned short>(buf[s].sc[h] >> (16 * e))));
          const float zp = float((buf[s].zw >> (8 * (2 * h + e))) & 0xFFu);
          const float acc = part[0][2 * h + e] + part[1][2 * h + e];
          tot[h] = __fmaf_rn(scale, acc - __fmaf_rn(zp, blk.y, blk.x), tot[h]);
        }
      }
      load_next(buf[s]);
      if (++j < nch) continue;
      j = 0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tot[h] += __shfl_xor_sync(0xffffffffu, tot[h], 1);
        tot[h] += __shfl_xor_sync(0xffffffffu, tot[h], 2);
      }
      const int tile = (int(blockIdx.x) + it * int(gridDim.x)) * kTilesCta + wt;
      if constexpr (WK == 1) {
        if (t == 0 && tile < p.blocks) {
          yraw[tile * 16 + g] = __float2half(tot[0]);
          yraw[tile * 16 + g + 8] = __float2half(tot[1]);
        }
      } else {
        float* part_s = s_part + ((it & 1) * kWarps + wk) * 16;
        if (t == 0) {
          part_s[g] = tot[0];
          part_s[g + 8] = tot[1];
        }
        // The tile's WK warps only (named barrier 1 + wt).
        asm volatile("bar.sync %0, %1;" ::"r"(1 + wt), "r"(WK * 32) : "memory");
        if (kp == 0 && lane < 16 && tile < p.blocks) {
          float v = 0.f;
#pragma unroll
          for (int w = 0; w < WK; ++w) v += part_s[w * 16 + lane];
          yraw[tile * 16 + lane] = __float2half(v);
        }
      }
      ++it;
      tot[0] = tot[1] = 0.f;
    }
  }
}

struct Variant {
  const char* name;
  bool rec;
  int wk;
  void (*fn[2])(GemvParams, const uint8_t*, __half*);  // [norm]
};
#define JOA_LEAN(rec, wk, d) \
  { #rec "-wk" #wk "-d" #d, rec, wk, {LeanKernel<rec, wk, d, PlainInput>, LeanKernel<rec, wk, d, RmsNormInput>} }
static const Variant kVariants[] = {
    JOA_LEAN(false, 1, 2), JOA_LEAN(false, 2, 2), JOA_LEAN(false, 4, 2), JOA_LEAN(false, 8, 2),
    JOA_LEAN(true, 1, 2),  JOA_LEAN(true, 2, 2),  JOA_LEAN(true, 4, 2),  JOA_LEAN(true, 8, 2),
    JOA_LEAN(false, 1, 3), JOA_LEAN(true, 1, 3),  JOA_LEAN(true, 2, 3),  JOA_LEAN(true, 4, 3),
};

int main() {
  const char* only_v = getenv("JOA_PROBE_VARIANT");
  ProbeEnv env;
  CK(MakeProbeEnv(env));
  const int sms = env.sms;
  cudaStream_t s = env.stream;
  uint32_t* sink = env.sink;
  printf("us a call (chains of launches on distinct weights, CUDA graph); err = max|lean - ring| (max|ring|)\n");
  for (const Shape& sh : kDecoderShapes) {
    if (!ProbeWants(sh)) continue;
    const size_t wbytes = size_t(sh.n) * sh.k / 2;
    const int L = sh.n > 100000 ? 4 : 24;
    const Fusion f{sh.gated, sh.norm};
    const Plan slots = MakePlan(1, sh.n, sh.k, 4, sh.gated, sh.norm, true, 0, 0, true, 32, true);
    const Plan ring = MakePlan(1, sh.n, sh.k, 4, sh.gated, sh.norm, true, 0, 0, true, 32, false);
    if (!slots.slots) {
      printf("%s: no slots plan\n", sh.name);
      continue;
    }
    __half *x, *gamma, *scales;
    uint8_t* zeros;
    CK(cudaMalloc(&x, sh.k * 2));
    FillHalf<<<64, 256>>>(x, sh.k, 1, -1.f, 1.f);
    CK(cudaMalloc(&gamma, sh.k * 2));
    FillHalf<<<64, 256>>>(gamma, sh.k, 2, 0.5f, 1.5f);
    const size_t meta = size_t(sh.n / 16) * (sh.k / 32) * 16;
    CK(cudaMalloc(&scales, meta * 2 * L));
    FillHalf<<<256, 256>>>(scales, meta * L, 3, 0.001f, 0.01f);
    CK(cudaMalloc(&zeros, meta * L));
    Fill<<<256, 256>>>(zeros, meta * L, 4, 15);
    std::vector<uint8_t*> ws(L), recs(L);
    std::vector<__half*> ys(L), yraws(L);
    std::vector<GemvParams> ps(L);
    const size_t rec_bytes = size_t(sh.n / 16) * (sh.k / 256) * kRecBytes;
    for (int i = 0; i < L; ++i) {
      CK(cudaMalloc(&ws[i], wbytes));
      Fill<<<1024, 256>>>(ws[i], wbytes, 10 + i, 0xFF);
      CK(cudaMalloc(&ys[i], size_t(sh.n) * 2));
      CK(cudaMalloc(&yraws[i], size_t(sh.n) * 2));
      CK(cudaMalloc(&recs[i], rec_bytes));
      ps[i] = OneRowParams(x, ws[i], scales + meta * i, zeros + meta * i, sh.norm ? gamma : nullptr, ys[i], sh.k, sh.n,
                           sh.gated);
      ToRecords<<<1024, 256>>>(ps[i], recs[i]);
    }
    CK(cudaDeviceSynchronize());
    float t_stream, t_ring, t_slots;
    CK((TimeGraphChain(L, [&](int i, cudaStream_t st) {
      StreamKernel<<<4 * sms, kThreads, 0, st>>>(ws[i], wbytes / 16, sink);
      return cudaGetLastError(); }, true, s, 50, 3, &t_stream)));
    CK((TimeGraphChain(L, [&](int i, cudaStream_t st) { return LaunchFormat<__half, 4, true>(ps[i], ring, f, false, st); },
                      true, s, 50, 3, &t_ring)));
    CK((TimeGraphChain(L, [&](int i, cudaStream_t st) {
      return LaunchFormat<__half, 4, true>(ps[i], slots, f, false, st); }, true, s, 50, 3, &t_slots)));
    std::vector<__half> y_ring(sh.n), y_lean(sh.n);
    if (!sh.gated) {
      CK((LaunchFormat<__half, 4, true>(ps[0], ring, f, false, s)));
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(y_ring.data(), ys[0], sh.n * 2, cudaMemcpyDeviceToHost));
    }
    printf("%-34s stream %7.2f  ring %7.2f  slots %7.2f  (slots grid %d)\n", sh.name, t_stream, t_ring, t_slots,
           slots.grid);
    for (const Variant& v : kVariants) {
      if (only_v != nullptr && std::string(v.name) != only_v) continue;
      if (slots.kc % v.wk != 0) continue;  // every warp of a tile the same chunk count (named barrier)
      GemvParams q0 = ps[0];
      ApplyPlan(q0, slots, false);
      const int smem = SlotsSmemBytes(q0, sh.norm) + 2 * kWarps * 16 * 4;
      auto fn = v.fn[sh.norm ? 1 : 0];
      CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const int groups = (q0.blocks + kWarps / v.wk - 1) / (kWarps / v.wk);
      const int grid = std::min(groups, 2 * sms);
      auto launch = [&](int i, cudaStream_t st) {
        GemvParams q = ps[i];
        ApplyPlan(q, slots, false);
        fn<<<grid, kThreads, smem, st>>>(q, recs[i], yraws[i]);
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
      printf("    %-16s %7.2f  (%.2fx slots, %.2fx stream)  grid %d  err %.4g (%.4g)\n", v.name, tv, t_slots / tv,
             t_stream / tv, grid, err, ymax);
    }
    fflush(stdout);
    for (int i = 0; i < L; ++i) {
      cudaFree(ws[i]);
      cudaFree(ys[i]);
      cudaFree(yraws[i]);
      cudaFree(recs[i]);
    }
    cudaFree(x);
    cudaFree(gamma);
    cudaFree(scales);
    cudaFree(zeros);
  }
  return 0;
}
