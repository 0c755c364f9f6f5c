// Probe: a multi-row int4 GEMV (y[M, N] = x[M, K] W^T, W in ONNX MatMulNBits order: B [N, K/bs, bs/2]
// uint8 with the low nibble the even k, scales [N, K/bs] f16, zero points [N, K/bs] uint8 0..15) for
// M in {1, 8, 16, 32}, bs 32 and 128, f16, against a kernel that only reads the bytes it reads (W,
// scales, zero points). Why: the engine's ring kernel runs at 0.12-0.5 of that floor at M = 8..32
// (bench/results/2026-12-01-gemv-ring-layouts.json); it stages all of x per CTA (64 KB at M = 8,
// K = 4096), which caps its occupancy and ring depth.
//
// Design (the probe's own code; technique from Marlin's pre-shuffled weights and lop3 dequant, and
// from our dense_row.cuh / slots.cuh):
// - W is the MMA A operand (m16 = output features), x the B operand (n8 = rows of x: NB = 1, 2, 4
//   n8 blocks for M <= 8, 16, 32; rows past M are zeros), so a dequantised A fragment serves NB MMAs.
// - Layout (ShuffleW, on the device from the ONNX order): a warp owns a row group of 64 features
//   (four m16 tiles). For each k16 step the group's 512 bytes are lane-major: lane (g, t)'s 16 bytes
//   are 4 words, word i = the A fragment of tile i as 8 nibbles (n0, n4) = rows g, k 2t / 2t + 1,
//   (n1, n5) = row g + 8, (n2, n6) = row g, k + 8, (n3, n7) = row g + 8, k + 8. A warp's stream along
//   K is contiguous (512 bytes a step). Dequant of a word: v, v >> 8 with masks 0x000F000F /
//   0x00F000F0 | 0x64006400 (one shift, four lop3): 1024 + q for rows g, 1024 + 16 q for rows g + 8,
//   the latter brought back with one exact hfma2 (x 1/16, then + 960 or - (64 + z)).
// - Scales / zero points: per (row group, block, g) 16 bytes of 8 scales (rows g + 8 h + 16 i) and
//   8 bytes of zero points, in the same ring as W (loaded with the stage that starts a block).
//   MODE 0 ("acc"): A = 1024 + q exactly; each block's MMAs accumulate into C from zero and the
//   block ends with acc += s C - s (1024 + z) X[col] (f32; X = the block's sum of x per x row, once
//   per CTA). Products are exact and sums f32: the only roundings are f32 (the 1024 offset costs
//   ~2^-14 of a weight's value against the reference's 2^-11). MODE 1 ("a"): A = (q - z) * s in f16
//   (hsub2 / hfma2 exact, one hmul2 rounding: the reference's own rounding of each weight), one
//   accumulator, no per-block work. 0 is cheaper per weight, 1 per block: auto = 0 for bs >= 128 or
//   M <= 8, else 1.
// - Geometry: a CTA of RW warps owns RW row groups (64 RW features) and a K slice K / S; clusters of
//   S CTAs split K (S = 1: none). x is staged per CTA for its K slice only (M x K/S halves, in B
//   fragment order: one conflict-free 16-byte shared load per lane per n8 block gives two k16
//   steps), so the x slice is small and the grid fills the SMs. Each warp streams W straight into
//   registers DS stages (k32, 32 bytes a lane, 1 KB a warp) ahead. The S partial sums of an output
//   are added over the cluster through distributed shared memory in rank order (deterministic, no
//   atomics): partials into the CTA's shared memory (aliasing x), cluster barrier, rank r adds rows
//   [r R/S, (r + 1) R/S) of the row block over ranks 0..S-1 (16-byte loads) and writes y (f16),
//   cluster barrier.
//
// SASS (cuobjdump -sass, the unrolled loop body over DS stages, per 16 bytes of W a lane): M <= 8
// 50 instructions (bs 128, MODE 0: 17 lop3, 9 hfma2, 4 HMMA, 4 FFMA; 10 B of W a warp instruction)
// to 83 (bs 32, MODE 0: the per-block flush, 16 FFMA); M = 16 59-79; M = 32 77 (bs 128, MODE 0)
// to 88 (bs 32, MODE 1), against ~6 B a warp instruction needed at ~3 IPC for 4.8 TB/s. Registers
// 98-128 (NB 1), 128-228 (NB 2), 167-254 (NB 4), no spills.
//
// H200, the first device runs (to redo at this commit): correct everywhere (worst error 0.15 of the
// bound). Their reduction read 4-byte scattered DSMEM / shared words: 9-11 us a launch at M = 8
// (8b-o at S 16, 8b-lm at S 1; measured by dropping it), now 16-byte row-contiguous loads; and x's
// staging waited one L2 round trip per item a thread (3.5 us at 8b-lm, M = 8), now 4 items at once.
// Neither change has run on a device yet (the check will say). With that cost in, M = 8, bs 128, stream / rows us: 8b-gate-up 15.5 / 26,
// 8b-lm 63 / 83, 8b-down 8.7 / 23.6, 8b-o 3.7 / 12.2, 8b-qkv 4.8 / 13.6 (the ring kernel's best
// layouts: 42, 121, 30.8, 12.0, 17.5); M = 1 0.33-0.85 of stream; M = 32 0.1-0.3
// (issue-bound: ~80 instructions a 16 bytes and 1 CTA an SM at 250 registers). DS 8 was slower
// than DS 4 at M = 8 on every ~8B shape; the W stream is not the limit at these sizes, the fixed
// per-launch chain (x staging, two W round trips, reduction) and the instruction count are.
//
// Check: a naive reference (f32 (q - z) * s * x) per output; bound |y - ref| <= 2^-11 (sum |(q - z)
// s x| + |ref|) + 1e-6: the first term is the worst case of the reference's own rounding of each
// dequantised weight to f16 (what an f16-dequant kernel may differ by), the second y's rounding to
// f16. Exits 1 if any output exceeds it (or on a CUDA error).
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -diag-suppress=940,2473,128 -I ffi -I tools/probes tools/probes/gemv_int4_rows.cu \
//     -o build/gemv_int4_rows
// Run: tools/probes/run_int4_rows.sh build/gemv_int4_rows (a sweep into $OUT/int4_rows.txt).
// Env: JOA_PROBE_8B=1 adds the ~8B shapes (2: only them); JOA_PROBE_ONLY=<shape prefix>;
//   JOA_PROBE_M=1|8|16|32 (default all); JOA_PROBE_BS=32|128 (default both);
//   JOA_PROBE_MODE=0|1 (default auto, above); JOA_PROBE_DS=2|4|8 stages in flight a warp (default
//   4: 4 KB a warp; 8 only for M <= 16, registers); JOA_PROBE_RW=1|2|4|8 warps (row groups) a CTA,
//   JOA_PROBE_S=1|2|4|8|16 cluster K split (default: planned, PlanFor); JOA_PROBE_WARPS=<n> the
//   planner's target of warps in the grid (default 1024); JOA_PROBE_CHECK=0 skips the reference.
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <tuple>
#include <vector>

#include "graph_chain.h"
#include "kernels/gemv/weights.cuh"  // AndOr, Prmt
#include "kernels/ptx.cuh"           // Mma16816Free
#include "probe_util.h"

namespace cg = cooperative_groups;

namespace {

using joa::gemv::AndOr;         // (a & b) | c: the magic-number halves
using joa::gemv::LoadStream16;  // W / scales, read once (not kept in L1)
using joa::gemv::Prmt;
// f16 m16n8k16, f32 accumulators; the non-volatile form, so independent chains interleave.
constexpr auto Mma = joa::ptx::Mma16816Free<__half>;

constexpr int kRowsPerGroup = 64;  // a warp's features: four m16 tiles

__device__ __forceinline__ uint32_t HFma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t HSub2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t HMul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint2 LoadStream8(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

struct Params {
  const uint4* w;   // [row groups][K / 16][32 lanes] 16 bytes
  const uint4* sc;  // [row groups][K / bs][8 g] 8 scales (rows g + 8 h + 16 i at half 2 i + h)
  const uint2* zr;  // [row groups][K / bs][8 g] 8 zero points, bytes in the same order
  const __half* x;  // [M][K]
  __half* y;        // [M][N]
  int m, n, k, kb, bshift;
};

// Shared memory: x slice in fragment order (stages * NB * 32 units of 16 bytes); MODE 0 adds the
// per-chunk sums of x ([stages][8 NB] f32) and per-block sums ([blocks][8 NB]); after the stream the
// partial sums [8 NB columns][RW * 64 + 8 rows] f32 alias the start (rows contiguous: the reduction
// reads 16 bytes a thread, 512 contiguous bytes a warp, also from other CTAs of the cluster; the
// stride's + 8 spreads the accumulator stores over the banks).
__host__ __device__ inline int SmemBytes(int nb, int mode, int ks, int bs, int rw) {
  const int stages = ks / 32;
  int x = stages * nb * 32 * 16;
  if (mode == 0) x += stages * 8 * nb * 4 + (ks / bs) * 8 * nb * 4;
  const int part = 8 * nb * (rw * kRowsPerGroup + 8) * 4;
  return x > part ? x : part;
}

// NB n8 blocks of x rows, DS k32 stages in flight a warp, MODE (above), SPB k32 stages a block
// (1: bs 32, 4: bs 128).
template <int NB, int DS, int MODE, int SPB>
__global__ void __launch_bounds__(256) Int4RowsKernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rw = blockDim.x >> 5;
  cg::cluster_group cluster = cg::this_cluster();
  const int S = int(cluster.num_blocks());
  const int rank = int(cluster.block_rank());
  const int rb = blockIdx.x / S;
  const int rg = rb * rw + warp;
  const int rgs = (p.n + kRowsPerGroup - 1) / kRowsPerGroup;
  const int ks = p.k / S, k0 = rank * ks, stages = ks / 32;
  const int bs = 1 << p.bshift;
  const bool live = rg < rgs;

  // The W / metadata ring: DS stages ahead, straight into registers.
  struct Stage {
    uint4 w[2];  // k16 steps 0, 1 of the stage
    uint4 sc;    // with the stage that starts a block
    uint2 zr;
  };
  const uint4* wp = p.w + (int64_t(rg) * (p.k / 16) + k0 / 16) * 32 + lane;
  const int64_t meta0 = (int64_t(rg) * p.kb + (k0 >> p.bshift)) * 8 + g;
  int ld = 0;
  auto load = [&](Stage& st, bool block_start) {
    if (live && ld < stages) {
      st.w[0] = LoadStream16(wp);
      st.w[1] = LoadStream16(wp + 32);
      wp += 64;
      if (block_start) {
        const int64_t at = meta0 + int64_t(ld / SPB) * 8;
        st.sc = LoadStream16(p.sc + at);
        st.zr = LoadStream8(p.zr + at);
      }
    }
    ++ld;
  };
  // Whether stage st0 + s starts a block, at compile time where DS % SPB == 0 (st0 % DS == 0).
  auto starts = [&](int s, int st) { return (DS % SPB == 0) ? (s % SPB == 0) : (st % SPB == 0); };
  Stage buf[DS];
#pragma unroll
  for (int s = 0; s < DS; ++s) load(buf[s], starts(s, s));

  // x slice into fragment order: thread (c, m) reads x[m][k0 + 32 c .. + 31] (64 bytes) and writes
  // the units of lanes (g = m % 8, t = 0..3) of n8 block m / 8: {w[t], w[t + 4], w[t + 8], w[t + 12]}
  // with w[j] = x[m][32 c + 2 j, + 1].
  uint4* s_x = reinterpret_cast<uint4*>(smem);
  float* s_csum = reinterpret_cast<float*>(smem + stages * NB * 32 * 16);
  float* s_xsum = s_csum + stages * 8 * NB;
  // kXBatch items a thread in flight at once (one L2 round trip where items <= kXBatch threads).
  constexpr int kXBatch = 4;
  const int items = stages * 8 * NB;
  for (int base = tid; base < items; base += kXBatch * int(blockDim.x)) {
    uint4 xv[kXBatch][4];
#pragma unroll
    for (int b = 0; b < kXBatch; ++b) {
      const int idx = base + b * int(blockDim.x);
      const int c = idx / (8 * NB), m = idx % (8 * NB);
      const uint4* src = reinterpret_cast<const uint4*>(p.x + int64_t(m) * p.k + k0 + 32 * c);
#pragma unroll
      for (int u = 0; u < 4; ++u)
        xv[b][u] = idx < items && m < p.m ? __ldg(src + u) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int b = 0; b < kXBatch; ++b) {
      const int idx = base + b * int(blockDim.x);
      if (idx >= items) break;
      const int c = idx / (8 * NB), m = idx % (8 * NB);
      uint32_t w[16];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        w[4 * u] = xv[b][u].x, w[4 * u + 1] = xv[b][u].y, w[4 * u + 2] = xv[b][u].z, w[4 * u + 3] = xv[b][u].w;
      }
      uint4* dst = s_x + (c * NB + m / 8) * 32 + (m % 8) * 4;
      // Lanes m and m + 1 write 64 bytes apart: rotating the unit order by m spreads eight lanes' 16-byte
      // stores over all banks.
#pragma unroll
      for (int u0 = 0; u0 < 4; ++u0) {
        const int u = (u0 + m) & 3;
        dst[u] = make_uint4(u == 0 ? w[0] : u == 1 ? w[1] : u == 2 ? w[2] : w[3],
                            u == 0 ? w[4] : u == 1 ? w[5] : u == 2 ? w[6] : w[7],
                            u == 0 ? w[8] : u == 1 ? w[9] : u == 2 ? w[10] : w[11],
                            u == 0 ? w[12] : u == 1 ? w[13] : u == 2 ? w[14] : w[15]);
      }
      if constexpr (MODE == 0) {
        float sum = 0.f;  // k order
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
          sum += f.x;
          sum += f.y;
        }
        s_csum[idx] = sum;
      }
    }
  }
  if constexpr (MODE == 0) {
    __syncthreads();
    const int spb = bs / 32;
    for (int idx = tid; idx < (ks / bs) * 8 * NB; idx += blockDim.x) {
      const int b = idx / (8 * NB), m = idx % (8 * NB);
      float sum = 0.f;
      for (int c = 0; c < spb; ++c) sum += s_csum[(b * spb + c) * 8 * NB + m];
      s_xsum[idx] = sum;
    }
  }
  __syncthreads();

  float acc[4][NB][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][nb][e] = 0.f;
  float cblk[MODE == 0 ? 4 : 1][MODE == 0 ? NB : 1][4];  // MODE 0: the block's C
  // The current block's metadata, derived once per block. MODE 0: rows (i, h) scale and
  // -scale (1024 + z) in f32; MODE 1: scale (f16 x2) and the f16 x2 pattern that removes the zero
  // point: rows g (h 0) 1024 + z for hsub2, rows g + 8 (h 1) -(64 + z) for the hfma2 with 1/16.
  float fs[4][2], fnz[4][2];
  uint32_t s2[4][2], zp[4][2];
  (void)fs, (void)fnz, (void)s2, (void)zp, (void)cblk;

  const uint4* xs = s_x + lane;
  const uint32_t kMagic = 0x64006400u, kSixteenth = 0x2C002C00u /* 1/16 */, k960 = 0x63806380u /* 960 */;
  if (live) {
    for (int st0 = 0; st0 < stages; st0 += DS) {
#pragma unroll
      for (int s = 0; s < DS; ++s) {
        const int st = st0 + s;
        if (st >= stages) break;
        Stage& cur = buf[s];
        if (starts(s, st)) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t sw = Word(cur.sc, i);
            const uint32_t zw = i < 2 ? cur.zr.x : cur.zr.y;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint32_t jj = (2 * i + h) & 3;  // byte of the zero point in zw
              if constexpr (MODE == 0) {
                const unsigned short sbits = static_cast<unsigned short>(h ? sw >> 16 : sw & 0xffff);
                const float sf = __half2float(__ushort_as_half(sbits));
                const float zf = float((zw >> (8 * jj)) & 0xff);
                fs[i][h] = sf;
                fnz[i][h] = -sf * (1024.f + zf);
              } else {
                s2[i][h] = Prmt(sw, sw, h ? 0x3232u : 0x1010u);
                // bytes (z, 0x64, z, 0x64) = f16 x2 1024 + z; (16 z, 0xD4, ..) = -(64 + z).
                const uint32_t sel = 0x4040u | jj | (jj << 8);
                zp[i][h] = h ? Prmt(zw << 4, 0xD4u, sel) : Prmt(zw, 0x64u, sel);
              }
            }
          }
          if constexpr (MODE == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
              for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) cblk[i][nb][e] = 0.f;
          }
        }
        uint4 xb[NB];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) xb[nb] = xs[(st * NB + nb) * 32];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t v = Word(cur.w[j], i), v8 = v >> 8;
            uint32_t a[4];
            a[0] = AndOr(v, 0x000F000Fu, kMagic);   // row g, k 2t..: 1024 + q
            a[1] = AndOr(v, 0x00F000F0u, kMagic);   // row g + 8: 1024 + 16 q
            a[2] = AndOr(v8, 0x000F000Fu, kMagic);  // row g, k + 8
            a[3] = AndOr(v8, 0x00F000F0u, kMagic);  // row g + 8, k + 8
            if constexpr (MODE == 0) {
              a[1] = HFma2(a[1], kSixteenth, k960);  // 64 + q + 960, exact
              a[3] = HFma2(a[3], kSixteenth, k960);
#pragma unroll
              for (int nb = 0; nb < NB; ++nb) Mma(cblk[i][nb], a, j ? xb[nb].z : xb[nb].x, j ? xb[nb].w : xb[nb].y);
            } else {
              a[0] = HMul2(HSub2(a[0], zp[i][0]), s2[i][0]);  // (q - z) exact, one rounding by s
              a[2] = HMul2(HSub2(a[2], zp[i][0]), s2[i][0]);
              a[1] = HMul2(HFma2(a[1], kSixteenth, zp[i][1]), s2[i][1]);
              a[3] = HMul2(HFma2(a[3], kSixteenth, zp[i][1]), s2[i][1]);
#pragma unroll
              for (int nb = 0; nb < NB; ++nb) Mma(acc[i][nb], a, j ? xb[nb].z : xb[nb].x, j ? xb[nb].w : xb[nb].y);
            }
          }
        }
        if constexpr (MODE == 0) {
          const bool ends = (DS % SPB == 0) ? (s % SPB == SPB - 1) : ((st + 1) % SPB == 0);
          if (ends) {  // acc += s C - s (1024 + z) X[col]
            const int b = st / SPB;
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
              const float2 X = *reinterpret_cast<const float2*>(s_xsum + (b * NB + nb) * 8 + 2 * t);
#pragma unroll
              for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  const int h = e >> 1;
                  const float xc = (e & 1) ? X.y : X.x;
                  acc[i][nb][e] = fmaf(fnz[i][h], xc, fmaf(fs[i][h], cblk[i][nb][e], acc[i][nb][e]));
                }
            }
          }
        }
        load(cur, starts(s, st + DS));  // stage st + DS into the registers just consumed
      }
    }
  }

  // Partial sums over x's region, then the cluster's fixed-order sum. Rank r owns rows
  // [r R/S, (r + 1) R/S) of the row block (R = 64 RW): a thread adds 4 consecutive rows of one x row
  // over ranks 0..S-1 (float4 loads: scattered 4-byte DSMEM loads cost ~10 us a launch here) and
  // writes 4 halves of y.
  __syncthreads();
  float* part = reinterpret_cast<float*>(smem);
  const int rows = rw * kRowsPerGroup, pstride = rows + 8;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = warp * kRowsPerGroup + 16 * i + g + 8 * (e >> 1);
        part[(8 * nb + 2 * t + (e & 1)) * pstride + row] = acc[i][nb][e];
      }
  cluster.sync();
  const int per4 = rows / S / 4;  // S | 64 RW / 4: S <= 16, a power of two
  const int r0 = rank * per4 * 4;
  for (int idx = tid; idx < p.m * per4; idx += blockDim.x) {
    const int m = idx / per4, row = r0 + 4 * (idx % per4);  // consecutive threads: consecutive rows
    const int n = rb * rows + row;
    if (n >= p.n) continue;  // N % 4 == 0: the 4 rows are all in or out
    const float* at = part + m * pstride + row;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q0 = 0; q0 < S; q0 += 4) {  // 4 ranks' loads in flight, added in rank order
      float4 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int q = q0 + j;
        if (q < S) v[j] = *reinterpret_cast<const float4*>(q == rank ? at : cluster.map_shared_rank(at, q));
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (q0 + j < S) sum.x += v[j].x, sum.y += v[j].y, sum.z += v[j].z, sum.w += v[j].w;
    }
    const __half2 lo = __floats2half2_rn(sum.x, sum.y), hi = __floats2half2_rn(sum.z, sum.w);
    *reinterpret_cast<uint2*>(p.y + int64_t(m) * p.n + n) =
        make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
  }
  cluster.sync();  // no CTA leaves while others read its partials
}

// ONNX order -> the probe's layout (above). One thread per 16-byte unit of W.
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

struct Plan {
  int rw = 0, s = 0, ctas = 0, smem = 0;
};
constexpr int kSmemCap = 200 * 1024;

// Bytes in flight first: a warp holds DS KB of W in flight, so aim for `target_warps` warps (default
// 1024: 8 an SM, 32 KB an SM at DS 4); then >= 128 CTAs (every SM streams); then many features a CTA
// (x is read once per CTA: 64 RW features); then the fewest K splits (partials, cluster size).
Plan PlanFor(int n, int k, int bs, int nb, int mode, int force_rw, int force_s, int target_warps) {
  const int rgs = (n + kRowsPerGroup - 1) / kRowsPerGroup;
  Plan best;
  auto key = [&](const Plan& pl) {
    return std::make_tuple(std::min(pl.ctas * pl.rw, target_warps), std::min(pl.ctas, 128), pl.rw, -pl.s);
  };
  for (int rw : {8, 4, 2, 1}) {
    if (force_rw && rw != force_rw) continue;
    for (int s : {1, 2, 4, 8, 16}) {
      if (force_s && s != force_s) continue;
      if (k % (s * bs) != 0) continue;
      Plan pl{rw, s, (rgs + rw - 1) / rw * s, SmemBytes(nb, mode, k / s, bs, rw)};
      if (pl.smem > kSmemCap) continue;
      if (best.ctas == 0 || key(pl) > key(best)) best = pl;
    }
  }
  return best;
}

using KernelFn = void (*)(Params);
template <int NB, int DS, int MODE>
KernelFn PickSpb(int spb) {
  return spb == 1 ? Int4RowsKernel<NB, DS, MODE, 1> : Int4RowsKernel<NB, DS, MODE, 4>;
}
template <int NB, int DS>
KernelFn PickMode(int mode, int spb) {
  return mode == 0 ? PickSpb<NB, DS, 0>(spb) : PickSpb<NB, DS, 1>(spb);
}
template <int NB>
KernelFn PickDs(int ds, int mode, int spb) {
  if constexpr (NB <= 2) {
    if (ds == 8) return PickMode<NB, 8>(mode, spb);
  }
  return ds == 2 ? PickMode<NB, 2>(mode, spb) : PickMode<NB, 4>(mode, spb);
}
KernelFn Pick(int nb, int ds, int mode, int spb) {
  return nb == 1 ? PickDs<1>(ds, mode, spb) : nb == 2 ? PickDs<2>(ds, mode, spb) : PickDs<4>(ds, mode, spb);
}

cudaError_t Launch(KernelFn fn, const Params& p, const Plan& pl, cudaStream_t s) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(pl.ctas);
  cfg.blockDim = dim3(32 * pl.rw);
  cfg.dynamicSmemBytes = pl.smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = pl.s;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, fn, p);
}

int EnvInt(const char* name, int dflt) { return getenv(name) ? atoi(getenv(name)) : dflt; }

}  // namespace

int main() {
  ProbeEnv env;
  CK(MakeProbeEnv(env));
  cudaStream_t s = env.stream;
  const int only_m = EnvInt("JOA_PROBE_M", 0), only_bs = EnvInt("JOA_PROBE_BS", 0);
  const int force_mode = EnvInt("JOA_PROBE_MODE", -1), ds_env = EnvInt("JOA_PROBE_DS", 4);
  const int force_rw = EnvInt("JOA_PROBE_RW", 0), force_s = EnvInt("JOA_PROBE_S", 0);
  const int target_warps = EnvInt("JOA_PROBE_WARPS", 1024);
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
        const int nb = M <= 8 ? 1 : M <= 16 ? 2 : 4;
        const int mode = force_mode >= 0 ? force_mode : (bs >= 128 || nb == 1) ? 0 : 1;
        const int spb = bs / 32;
        const int ds = ds_env == 2 ? 2 : ds_env == 8 && nb <= 2 ? 8 : 4;  // 8: NB <= 2 only (registers)
        const Plan pl = PlanFor(sh.n, sh.k, bs, nb, mode, force_rw, force_s, target_warps);
        if (pl.ctas == 0) {
          printf("%-34s M %2d bs %3d: no plan\n", sh.name, M, bs);
          continue;
        }
        KernelFn fn = Pick(nb, ds, mode, spb);
        CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, pl.smem));
        CK(cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, fn));

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
        std::vector<Params> ps(L);
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
          ps[i] = Params{reinterpret_cast<const uint4*>(cp[i]), reinterpret_cast<const uint4*>(cp[i] + wb),
                         reinterpret_cast<const uint2*>(cp[i] + wb + sb), x, y, M, sh.n, sh.k, kb, bs == 32 ? 5 : 7};
        }
        CK(cudaDeviceSynchronize());

        float err = 0.f, rmax = 0.f, ratio = 0.f;
        if (check) {
          float *ref, *absum;
          CK(cudaMalloc(&ref, size_t(M) * sh.n * 4));
          CK(cudaMalloc(&absum, size_t(M) * sh.n * 4));
          Reference<<<(sh.n + 127) / 128, 128>>>(b, scales, zeros, x, ref, absum, M, sh.n, sh.k, bs);
          CK(cudaGetLastError());
          CK(cudaMemset(y, 0xff, size_t(M) * sh.n * 2));  // NaN: unwritten outputs fail
          CK(cudaDeviceSynchronize());  // the legacy stream's memset before the kernel on `s`
          CK(Launch(fn, ps[0], pl, s));
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
        CK(time([&](int i, cudaStream_t st) { return Launch(fn, ps[i], pl, st); }, &t_rows));
        const double kbytes = total * 1e-3;
        printf("%-34s M %2d bs %3d mode %d DS %d RW %d S %2d grid %4d smem %6d regs %3d  stream %8.2f (%4.0f)  "
               "rows %8.2f "
               "(%4.0f)  frac %.2f  %.3g (%.3g, %.2f)%s\n",
               sh.name, M, bs, mode, ds, pl.rw, pl.s, pl.ctas, pl.smem, fa.numRegs, t_stream, kbytes / t_stream, t_rows,
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
