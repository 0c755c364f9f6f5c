// The GEMV engine's multi-row path for 4-bit weights: y[M, N] = epilogue(prologue(x)[M, K] W^T)
// for M = 2..32 (1 works) with W in the "rows" layout, made once at load
// (jax_onnx_attn.ops.linear.pack_nbits_rows). From tools/probes/gemv_int4_rows.cu (its MODE 1).
//
// Why: the ring kernel (kernel.cuh) stages all of x per CTA (64 KB at M = 8, K = 4096), which caps
// its occupancy and ring depth: 0.12-0.5 of a weights-only stream at M = 8..32. Here each CTA stages
// only its cluster rank's K slice of x, and each warp streams its W through a ring of its own.
//
// Layout (plan.h's kRowsGroup, kRowsStageK):
// - W (uint8 [ceil(N / 64), K / 16, 512]): a warp owns a row group of 64 W rows (four m16 tiles i).
//   For each k16 step j the group's 512 bytes are lane-major: lane (g, t)'s 16 bytes are 4 words,
//   word i = the MMA A fragment of tile i as 8 nibbles, nibble 4 e + 2 c + h = W[16 i + g + 8 h]
//   [16 j + 8 c + 2 t + e] (h: row g or g + 8; c: k or k + 8; e: the pair's element). A warp's
//   stream along K is contiguous (512 bytes a step, 1 KB a stage of 32 k).
// - scales (T [ceil(N / 64), K / bs, 64]) and zero points (uint8, the same shape, or none: 8):
//   per (row group, block) 8 values for each g, value 2 i + h = row 16 i + g + 8 h. A lane loads
//   its 16 + 8 bytes with the stage that starts a block.
// Rows past N are zeros (their outputs are never stored).
//
// Dequantisation of a word v (two nibbles a 32-bit pair, one lop3 each): f16 0x6400 | n = 1024 + n
// for the low nibbles (masks 0x000F000F on v, v >> 8) and 0x6400 | 16 n = 1024 + 16 n for the
// high ones (0x00F000F0); bf16 0x4300 | n = 128 + n (v >> 4 e). Then two exact-or-once-rounded
// fma: (raw * mul + add) = q - zp exactly (f16 rows g: 1 and -(1024 + zp); rows g + 8: 1/16 and
// -(64 + zp); bf16: 1 and -(128 + zp)), then (q - zp) * scale + (-0) rounded once to T: the
// reference's own dequantised weight (jax_onnx_attn.ops.reference.linear.dequantize_nbits), so the
// MMAs (f32 accumulation) see the reference's W.
//
// Geometry (plan.h's MakeRowsPlan): a CTA of warps_n warps owns warps_n row groups and K slice
// rank of the cluster's `cluster` CTAs, which split K. x's slice is staged once per CTA in B
// fragment order (a 16-byte shared load per lane per n8 tile gives two k16 steps), rows past M
// zeros; with the RMS-norm prologue each CTA sums its slice's squares and the cluster adds the CTAs'
// sums in rank order. Each warp keeps up to 2 RowsRingPairs(depth) - 2 stages of W in flight in its
// ring in shared memory (a stage: W 1 KB, then the row group's scales and zero points of a block). The
// cluster's partial sums are added in rank order (deterministic, no atomics): each CTA writes its
// partials into its shared memory (over x and the rings) grouped by the rank that finishes them,
// cluster barrier, then pushes each rank its group with one bulk copy (shared -> that rank's
// shared memory, completing on its mbarrier); rank r adds its 1 / cluster of the block's rows over
// ranks 0..cluster-1 from local shared memory and applies the epilogue.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/gemv/cluster.cuh"
#include "kernels/gemv/epilogue.cuh"
#include "kernels/gemv/params.h"
#include "kernels/gemv/plan.h"
#include "kernels/gemv/stage.cuh"
#include "kernels/gemv/weights.cuh"
#include "kernels/ptx.cuh"
#include "kernels/sm90_pipe.cuh"

// Probes (tools/probes/gemv_int4_rows.cu) define JOA_GEMV_MARK(phase) to time the kernel's phases.
#ifndef JOA_GEMV_MARK
#define JOA_GEMV_MARK(phase)
#endif

namespace joa::gemv {

// d = a * b + c on T pairs, one rounding.
template <typename T>
__device__ __forceinline__ uint32_t Fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  if constexpr (std::is_same_v<T, __half>) {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  } else {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  }
  return d;
}

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <typename T>
struct RowsDequant {
  static constexpr bool kHalf = std::is_same_v<T, __half>;
  static constexpr uint32_t kNegZero = 0x80008000u;

  // Per block and (tile i, h): the pair that multiplies the raw halves and the one added (the zero
  // point's offset, negated), from the block's zero-point bytes zw (byte jj = that of row (i, h)).
  __device__ __forceinline__ static uint32_t Mul(int h) {
    if constexpr (kHalf) return h ? 0x2C002C00u /* 1/16 */ : 0x3C003C00u /* 1 */;
    return 0x3F803F80u;  // 1
  }
  __device__ __forceinline__ static uint32_t Add(uint32_t zw, int h, int jj) {
    const uint32_t sel = 0x4040u | uint32_t(jj) | (uint32_t(jj) << 8);  // (z, hi, z, hi)
    if constexpr (kHalf) return h ? Prmt(zw << 4, 0xD4u, sel) /* -(64 + z): 16 z in the low byte */
                                  : Prmt(zw, 0xE4u, sel) /* -(1024 + z) */;
    return Prmt(zw, 0xC3u, sel);  // -(128 + z)
  }

};

// NT n8 tiles of x rows, DS the plan's depth (a warp's ring holds RowsRingPairs(DS) pairs of
// stages), SPB stages a block (1: bs 32, 4: bs 128), OCC the CTAs of kThreads an SM its registers
// are capped for (plan.ctas_per_sm; 2: 128 a thread). Occupancy 1 states no minimum below M = 25:
// with `.minnctapersm 1` ptxas took up to 142 registers at 2 stages, M <= 16, where it takes 126-128
// without (one CTA an SM instead of two). At NT = 4 and at depth 4 it states 1: without, ptxas
// held 128 (64 at M <= 8, depth 4, block 128) and spilled 4-8 bytes; with, 80-150, no spills (x's
// slice or the rings leave one CTA an SM there anyway).
template <typename T, int NT, int DS, int SPB, int OCC, class Prologue, class Epilogue>
__global__ void __launch_bounds__(kThreads, OCC > 1 ? OCC : NT == 4 || DS > 2 ? 1 : 0) GemvRowsKernel(const __grid_constant__ GemvParams p) {
  using D = RowsDequant<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int threads = int(blockDim.x);
  const int g = lane >> 2, t = lane & 3;
  const int S = p.cluster;
  const int rank = ClusterRank(S);
  const int rb = int(blockIdx.x) / S;
  const int rg = rb * p.warps_n + warp;
  const int rgs = (p.n_rows + kRowsGroup - 1) / kRowsGroup;
  const int ks = p.k / S, k0 = rank * ks, stages = ks / kRowsStageK;
  const bool live = rg < rgs;

  JOA_GEMV_MARK(0);
  ptx::LaunchDependents();
  // The barrier the other ranks' partial sums complete on (after the loop), expecting all of them.
  [[maybe_unused]] const uint32_t bar = ptx::SmemAddr(smem + RowsBarrierOffset(p.gamma_offset, Prologue::kNorm, threads, NT));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (S > 1 && tid == 0) {
    sm90::MbarInit(bar, 1);
    sm90::FenceBarrierInit();
    sm90::MbarArriveExpectTx(bar, RowsRecvBytes(p.m, p.rows_block, S));
  }
#endif

  // W first (a parameter: no kernel of the program writes it), then x after the previous kernel.
  // W and its block metadata go through the warp's ring in shared memory (cp.async, one copy group
  // a pair of stages), so the bytes in flight are the ring's, not the registers': with W loaded
  // straight into registers (2-4 KB a warp) the ~1B shapes ran at 0.2-0.9 TB/s (ncu, H200: one warp
  // a scheduler, a third of its cycles on the loads). Each lane copies, and later reads, only its
  // own 16-byte pieces of W; a stage's block metadata is copied once per g (plan.h's
  // kRowsStageScales / kRowsStageZeros) and read by g's four lanes, so the loop's handshake is
  // cp.async.wait_group of the lane's own groups, then a warp barrier (and one before a slot is
  // refilled: its metadata may still be read by the other lanes).
  constexpr int kPairs = RowsRingPairs(DS);
  unsigned char* ring = smem + p.ring_offset + int64_t(warp) * kPairs * 2 * kRowsRingStageBytes;
  const uint4* wsrc = static_cast<const uint4*>(p.w) + (int64_t(rg) * (p.k / 16) + k0 / 16) * 32 + lane;
  const int64_t meta0 = (int64_t(rg) * p.k_blocks + (k0 >> p.block_shift)) * 8 + g;
  const int pairs = (stages + 1) / 2;
  auto issue = [&](int pr) {  // the copies of stage pair pr into its ring slot, one group
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int st = 2 * pr + h;
      if (live && st < stages) {
        const uint32_t stage = ptx::SmemAddr(ring + ((pr % kPairs) * 2 + h) * kRowsRingStageBytes);
        ptx::CpAsync16(stage + 16 * lane, wsrc + int64_t(st) * 64, true);
        ptx::CpAsync16(stage + 16 * lane + 512, wsrc + int64_t(st) * 64 + 32, true);
        if (st % SPB == 0) {
          const int64_t m = meta0 + int64_t(st / SPB) * 8;
          if (t == 0) ptx::CpAsync16(stage + kRowsStageScales + 16 * g, static_cast<const uint4*>(p.scales) + m, true);
          if (t == 1 && p.zeros != nullptr) {
            ptx::CpAsync8(stage + kRowsStageZeros + 8 * g, reinterpret_cast<const uint2*>(p.zeros) + m, true);
          }
        }
      }
    }
    ptx::CpAsyncCommit();
  };
#pragma unroll
  for (int pr = 0; pr < kPairs - 1; ++pr) issue(pr);
  JOA_GEMV_MARK(1);

  ptx::WaitForPrimary();  // x, gamma, bias, residual may come from the previous kernel

  // x's slice into fragment order: item (c, m) = x[m][k0 + 32 c .. + 31] (64 bytes) becomes the units
  // of lanes (g = m % 8, t = 0..3) of n8 tile m / 8, unit t = pairs {t, t + 4, t + 8, t + 12} of the
  // item (pair j = elements 2 j, 2 j + 1). threads % (8 NT) == 0, so a thread's items share x row m.
  uint4* s_x = reinterpret_cast<uint4*>(smem);
  // Items a thread loads before it stores them (16 registers each): 4 keep a thread with 4 items
  // (the LM head's one-CTA slice at M <= 8) at one L2 round trip; 2 at depth 4, a choice from when W
  // stages sat in registers (this pass was then the register peak).
  constexpr int kBatch = DS > 2 ? 2 : 4;
  const int items = stages * 8 * NT;
  for (int base = tid; base < items; base += kBatch * threads) {
    uint4 xv[kBatch][4];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int idx = base + b * threads;
      const int c = idx / (8 * NT), m = idx % (8 * NT);
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + int64_t(m) * p.k + k0 + 32 * c);
#pragma unroll
      for (int u = 0; u < 4; ++u) xv[b][u] = idx < items && m < p.m ? LoadInput16(src + u) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int idx = base + b * threads;
      if (idx >= items) break;
      const int c = idx / (8 * NT), m = idx % (8 * NT);
      uint32_t w[16];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        w[4 * u] = xv[b][u].x, w[4 * u + 1] = xv[b][u].y, w[4 * u + 2] = xv[b][u].z, w[4 * u + 3] = xv[b][u].w;
      }
      uint4* dst = s_x + (c * NT + m / 8) * 32 + (m % 8) * 4;
      // Lanes m and m + 1 write 64 bytes apart: rotating the unit order by m spreads eight lanes'
      // 16-byte stores over all banks.
#pragma unroll
      for (int u0 = 0; u0 < 4; ++u0) {
        const int u = (u0 + m) & 3;
        dst[u] = make_uint4(u == 0 ? w[0] : u == 1 ? w[1] : u == 2 ? w[2] : w[3],
                            u == 0 ? w[4] : u == 1 ? w[5] : u == 2 ? w[6] : w[7],
                            u == 0 ? w[8] : u == 1 ? w[9] : u == 2 ? w[10] : w[11],
                            u == 0 ? w[12] : u == 1 ? w[13] : u == 2 ? w[14] : w[15]);
      }
    }
  }
  JOA_GEMV_MARK(2);
  if constexpr (Prologue::kNorm) {
    // Per x row m: sums of squares in an order that does not depend on NT, so an example's rows
    // folded with others (vmap) keep their bits: thread tid sums row m = 8 nt + tid % 8 of each
    // n8 tile nt over chunks c = tid / 8 (mod threads / 8) in order (read back from the fragment
    // order into x's element order), the threads' sums add in thread order, the cluster's CTAs in
    // rank order (every CTA gets the same bits). At NT = 1 this is the order the sums had when
    // they were taken as x was loaded. Then x <- round(x r gamma) in place, each thread on its
    // own items.
    float* s_tss = reinterpret_cast<float*>(smem + p.gamma_offset);  // [NT][threads]
    float* s_row = s_tss + NT * threads;                              // [kMaxM] this CTA's sums
    float* s_inv = s_row + kMaxM;                                     // [kMaxM] inverse RMS
    __syncthreads();  // x's slice is staged
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float ss = 0.f;
      for (int c = tid >> 3; c < stages; c += threads >> 3) {
        const uint4* src = s_x + (c * NT + nt) * 32 + (tid & 7) * 4;
        const uint4 u0 = src[0], u1 = src[1], u2 = src[2], u3 = src[3];
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // x's 16-byte piece r: word r of each unit
          ss = AddSquares8<T>(make_uint4(Word(u0, r), Word(u1, r), Word(u2, r), Word(u3, r)), ss);
        }
      }
      s_tss[nt * threads + tid] = ss;
    }
    __syncthreads();
    if (tid < 8 * NT) {
      const float* part = s_tss + (tid >> 3) * threads;
      float sum = 0.f;
      for (int i = tid & 7; i < threads; i += 8) sum += part[i];
      s_row[tid] = sum;
    }
    ClusterSync(S);
    if (tid < 8 * NT) {
      float sum = 0.f;
      for (int r = 0; r < S; ++r) sum += (r == rank ? s_row : RemoteShared(s_row, r))[tid];
      s_inv[tid] = rsqrtf(__fdiv_rn(sum, float(p.k)) + p.eps);
    }
    __syncthreads();
    const T* gamma = static_cast<const T*>(p.gamma);
    for (int idx = tid; idx < items; idx += threads) {
      const int c = idx / (8 * NT), m = idx % (8 * NT);
      if (m >= p.m) continue;  // zeros stay zeros
      const uint4* gsrc = reinterpret_cast<const uint4*>(gamma + k0 + 32 * c);
      uint32_t gw[16];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const uint4 v = LoadInput16(gsrc + u);
        gw[4 * u] = v.x, gw[4 * u + 1] = v.y, gw[4 * u + 2] = v.z, gw[4 * u + 3] = v.w;
      }
      uint4* dst = s_x + (c * NT + m / 8) * 32 + (m % 8) * 4;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        dst[u] = Prologue::template Apply<T>(dst[u], s_inv[m], make_uint4(gw[u], gw[u + 4], gw[u + 8], gw[u + 12]));
      }
    }
  }
  __syncthreads();
  JOA_GEMV_MARK(3);

  float acc[4][NT][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][nt][e] = 0.f;
  // The current block's scale pairs (row (i, h) in both halves) and zero-point offsets.
  uint32_t s2[4][2], z2[4][2];

  const uint4* xs = s_x + lane;
  for (int pr = 0; pr < pairs; ++pr) {
    __syncwarp();            // every lane's reads of slot pair pr - 1 (its metadata) are done
    issue(pr + kPairs - 1);  // into the slot pair pr - 1 left
    ptx::CpAsyncWait<kPairs - 1>();
    __syncwarp();            // pair pr's metadata, copied by lanes (g, 0) / (g, 1), is visible
    if (!live) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int st = 2 * pr + h;
      if (st >= stages) break;
      const unsigned char* stage = ring + ((pr % kPairs) * 2 + h) * kRowsRingStageBytes;
      const uint4 w0 = *reinterpret_cast<const uint4*>(stage + 16 * lane);
      const uint4 w1 = *reinterpret_cast<const uint4*>(stage + 16 * lane + 512);
      if (st % SPB == 0) {
        const uint4 sc = *reinterpret_cast<const uint4*>(stage + kRowsStageScales + 16 * g);
        const uint2 zr = p.zeros != nullptr ? *reinterpret_cast<const uint2*>(stage + kRowsStageZeros + 8 * g)
                                            : make_uint2(0x08080808u, 0x08080808u);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t sw = Word(sc, i);
          const uint32_t zw = i < 2 ? zr.x : zr.y;
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            s2[i][hh] = Prmt(sw, sw, hh ? 0x3232u : 0x1010u);
            z2[i][hh] = D::Add(zw, hh, (2 * i + hh) & 3);
          }
        }
      }
      uint4 xb[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) xb[nt] = xs[(st * NT + nt) * 32];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t a[4];  // (row g, k 2t..), (row g + 8), (row g, k + 8), (row g + 8, k + 8)
          MagicNibbles<T>(Word(j ? w1 : w0, i), a);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int hh = e & 1;
            a[e] = Fma2<T>(Fma2<T>(a[e], D::Mul(hh), z2[i][hh]), s2[i][hh], D::kNegZero);
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            ptx::Mma16816Free<T>(acc[i][nt], a, j ? xb[nt].z : xb[nt].x, j ? xb[nt].w : xb[nt].y);
          }
        }
      }
    }
  }
  ptx::CpAsyncWait<0>();  // no copy outlives the loop: the partials below alias x and the rings
  JOA_GEMV_MARK(4);

  // Partial sums, over x's area and the rings (plan.h's RowsPart*): this CTA's [S][8 NT][P] f32,
  // slot q holding rows [q per, (q + 1) per) of the block, which rank q finishes; then with a
  // cluster the slots the other ranks send this one (recv, the same shape, slot q from rank q).
  __syncthreads();
  const int per = RowsPartRows(p.rows_block, S), P = RowsPartPitch(p.rows_block, S);
  const int slot = RowsPartSlotFloats(p.rows_block, S, NT);
  float* part = reinterpret_cast<float*>(smem);
  [[maybe_unused]] const float* recv = part + S * slot;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int base = warp * kRowsGroup + 16 * i, q = base / per;
    float* dst = part + q * slot + base - q * per + g;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[(8 * nt + 2 * t + (e & 1)) * P + 8 * (e >> 1)] = acc[i][nt][e];
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (S > 1) {
    // Each rank pushes slot q to rank q (one bulk copy of its p.m rows, completing on q's barrier)
    // instead of every rank pulling S slices through distributed shared memory (a chain of remote
    // loads: 2-4 us a call at M 8-32, H200 timeline probe). The barrier before the copies: every
    // rank's loop is done (recv lies over its x and rings) and its barrier initialised.
    sm90::FenceProxyAsync();  // the partials, written by the threads, before the copies read them
    ClusterSync(S);
    JOA_GEMV_MARK(5);
    for (int j = tid; j < S - 1; j += threads) {
      const int q = (rank + 1 + j) % S;
      sm90::BulkCopyToCluster(sm90::MapShared(ptx::SmemAddr(recv + rank * slot), q), ptx::SmemAddr(part + q * slot),
                              uint32_t(p.m * P * 4), sm90::MapShared(bar, q));
    }
    sm90::MbarWait(bar, 0);
    // This rank has all it receives; once every rank has said so (the wait before the end), no copy
    // still reads this CTA's partials.
    sm90::ClusterArriveRelaxed();
  } else {
    __syncthreads();
  }
#else
  __syncthreads();
#endif
  // Rank r finishes its slot's rows in units of 8 outputs of one x row: the ranks' partial sums
  // added in rank order (every CTA's own from part, the others' from recv).
  const int units = Epilogue::OutCols(per) / 8;
  const int oc0 = Epilogue::OutCols(rank * per);
  for (int idx = tid; idx < p.m * units; idx += threads) {
    const int m = idx / units, oc = oc0 + 8 * (idx % units);
    Epilogue::template Apply<T>(p, m, rb, oc, [&](int r0, float (&v)[8]) {
      const int at = m * P + r0 - rank * per;
      float4 lo = make_float4(0.f, 0.f, 0.f, 0.f), hi = lo;
      for (int q = 0; q < S; ++q) {
        const float4* src = reinterpret_cast<const float4*>((q == rank ? part + rank * slot : recv + q * slot) + at);
        const float4 a = src[0], b = src[1];
        lo.x += a.x, lo.y += a.y, lo.z += a.z, lo.w += a.w;
        hi.x += b.x, hi.y += b.y, hi.z += b.z, hi.w += b.w;
      }
      v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    });
  }
  JOA_GEMV_MARK(7);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (S > 1) sm90::ClusterWait();
#endif
  JOA_GEMV_MARK(6);
}

}  // namespace joa::gemv
