// How the GEMV engine reads W: the weight-format policies. Each turns one lane's share of a chunk
// (one or two 16-byte pieces of row g and of row g + 8 of the warp's 16-row tile) into
// mma.m16n8k16 A fragments.
//
// The k-permutation. The order of k inside a dot product is free, so a lane (g = lane / 4,
// t = lane % 4) loads its pieces of a row (plan.h's FormatInfo: two 8-element pieces dense, one or
// (wide) two 16-byte pieces n-bit, 64 bytes apart in the row's chunk) from chunk c, and x is staged
// (stage.cuh) so that the B fragment of the same lane holds the x values
// of exactly the k that its A registers hold. mma.m16n8k16 takes, per lane, A = {row g k(2t, 2t+1),
// row g+8 k(2t, 2t+1), row g k(2t+8, 2t+9), row g+8 k(2t+8, 2t+9)} and B = {k(2t, 2t+1),
// k(2t+8, 2t+9)} of column g; any bijection of the 16 k of a step onto "logical" k that A and B
// share leaves the product unchanged. Per 16-byte x quad q of a lane, a policy returns the A
// registers of two k16 steps s = 0, 1, and the x quad's words are B = {x.w[2s], x.w[2s + 1]}:
//   dense (16 elements, two 16-byte quads): quad q, step s <- W words 2s, 2s+1 of quad q;
// and per 16-byte piece of n-bit weights (quad q of a wide lane is quad q % (quads / 2) of piece
// q / (quads / 2)):
//   8-bit (16 elements):  quad q, step s <- W word 2q + s: bytes (0, 1) and (2, 3);
//   4-bit (32 elements):  quad q <- W word q (8 nibbles e0..e7, element 8q + j in bits 4j): the
//     magic-number conversion yields pairs (e0, e4), (e1, e5), (e2, e6), (e3, e7) = step 0 lo, hi,
//     step 1 lo, hi; so x quad q is staged as (x0, x4, x1, x5, x2, x6, x3, x7) (kPermuteX).
// tests/test_linear.py emulates these maps in NumPy.
//
// Dequantisation is exact up to the one rounding of the reference ((q - zp) * scale computed in f32
// and rounded to T): q - zp is exact in T, the product is rounded once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/gemv/params.h"
#include "kernels/gemv/plan.h"
#include "kernels/ptx.cuh"

namespace joa::gemv {

// cp.async of 16 bytes, zero-filled when !valid (src is then not read), bypassing L1 (every W
// byte is read once), with the 128-byte L2 prefetch the decode engine measured best. The "memory"
// clobber keeps the compiler from moving shared-memory reads of the slot past its refill.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most n (0..7, warp-uniform) of this thread's newest copy groups are pending.
__device__ __forceinline__ void CpAsyncWaitPending(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;\n" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;\n" ::: "memory"); break;
  }
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// (a & b) | c in one instruction (ptx.cuh's, shared with the decode engine's unpack).
using ptx::AndOr;

__device__ __forceinline__ uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

template <typename T>
struct Half2;
template <>
struct Half2<__half> {
  using type = __half2;
};
template <>
struct Half2<__nv_bfloat16> {
  using type = __nv_bfloat162;
};

template <typename T>
__device__ __forceinline__ typename Half2<T>::type AsH2(uint32_t v) {
  return *reinterpret_cast<typename Half2<T>::type*>(&v);
}

template <typename H2>
__device__ __forceinline__ uint32_t AsU32(H2 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

// The 8 nibbles e0..e7 of v (element j in bits 4 j) as raw T pairs, one lop3 each:
// pr = (e0, e4), (e1, e5), (e2, e6), (e3, e7). f16: 0x6400 | n = 1024 + n for e0..e3's pairs at
// even positions (pr[0], pr[2]) and 0x6400 | 16 n = 1024 + 16 n for pr[1], pr[3] (no shift); bf16:
// 0x4300 | n = 128 + n for all (v >> 4 i: bf16 has no room for 16 n).
template <typename T>
__device__ __forceinline__ void MagicNibbles(uint32_t v, uint32_t (&pr)[4]) {
  if constexpr (std::is_same_v<T, __half>) {
    const uint32_t v8 = v >> 8;
    pr[0] = AndOr(v, 0x000F000Fu, 0x64006400u);
    pr[1] = AndOr(v, 0x00F000F0u, 0x64006400u);
    pr[2] = AndOr(v8, 0x000F000Fu, 0x64006400u);
    pr[3] = AndOr(v8, 0x00F000F0u, 0x64006400u);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) pr[i] = AndOr(v >> (4 * i), 0x000F000Fu, 0x43004300u);
  }
}

// (a - b) * s on 2 packed T values, each operation rounded once (a - b is exact here).
template <typename T>
__device__ __forceinline__ uint32_t SubMul(uint32_t a, uint32_t b, uint32_t s) {
  return AsU32(__hmul2(__hsub2(AsH2<T>(a), AsH2<T>(b)), AsH2<T>(s)));
}

// Dense T weights [n_rows, k]: a lane's 16 elements of a row per chunk are two 16-byte quads
// (elements 8 t and 32 + 8 t of the chunk: FormatInfo).
template <typename T>
struct DenseWeights {
  static constexpr int kBits = 16;
  static constexpr FormatInfo kInfo = Format(kBits);
  static constexpr bool kPermuteX = false;
  // Read() calls per chunk (each feeds quads / kReads quads): one, the whole chunk.
  static constexpr int kReads = 1;
  // A ring stage of a warp: [row g / g + 8][quad][lane][16 bytes].
  static constexpr int kStageBytes = 2 * kInfo.quads * 32 * 16;
  static_assert(kStageBytes == StageBytes(kBits), "plan.h sizes the ring");
  static_assert(kInfo.pieces == kInfo.quads, "a dense piece is one quad");
  struct Chunk {
    uint4 w[2][kInfo.quads];  // rows g, g + 8
  };
  // What a lane's copies and reads need that does not change from chunk to chunk.
  struct Lane {
    int lane, t;
  };
  __device__ __forceinline__ static Lane MakeLane(const GemvParams&, int lane) { return {lane, lane & 3}; }

  // Starts copying chunk c of W rows `row` and row + 8 (lane t) into `stage`. Rows past n_rows and
  // k past K land as zeros.
  __device__ __forceinline__ static void Issue(unsigned char* stage, const GemvParams& p, const Lane& ln,
                                               int row, int c) {
    const int t = ln.t, lane = ln.lane;
    const int kk = c * kInfo.chunk_k + kInfo.lane_stride * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row + 8 * h;
      const T* src = static_cast<const T*>(p.w) + int64_t(r) * p.k + kk;
#pragma unroll
      for (int q = 0; q < kInfo.quads; ++q) {
        const int at = QuadK(kInfo, q);
        const bool valid = r < p.n_rows && kk + at < p.k;
        CpAsync16(SmemAddr(stage + ((h * kInfo.quads + q) * 32 + lane) * 16),
                  valid ? static_cast<const void*>(src + at) : p.w, valid);
      }
    }
  }

  // The lane's own 16-byte pieces of a landed stage.
  __device__ __forceinline__ static Chunk Read(const unsigned char* stage, const GemvParams&, const Lane& ln,
                                               int) {
    const int lane = ln.lane;
    Chunk ch;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int q = 0; q < kInfo.quads; ++q) {
        ch.w[h][q] = *reinterpret_cast<const uint4*>(stage + ((h * kInfo.quads + q) * 32 + lane) * 16);
      }
    }
    return ch;
  }

  __device__ __forceinline__ static void Fragments(const Chunk& ch, int q, uint32_t (&a)[2][4]) {
    const uint4 &w0 = ch.w[0][q], &w1 = ch.w[1][q];
    a[0][0] = w0.x; a[0][1] = w1.x; a[0][2] = w0.y; a[0][3] = w1.y;
    a[1][0] = w0.z; a[1][1] = w1.z; a[1][2] = w0.w; a[1][3] = w1.w;
  }
};

// MatMulNBits weights: uint8 [n_rows, k * kBits / 8] (onnxruntime's [N, k_blocks, blob] rows, element
// j of a block in bits (j % (8 / kBits)) * kBits of byte j / (8 / kBits)); scales T and zero points
// uint8 (or none: 2^(kBits - 1)) tiled [ceil(n_rows / 16), k_blocks, 16] (params.h): the 16 rows of
// a warp's tile for one block are 32 / 16 contiguous bytes. W = (q - zp) * scale. Each 16-byte
// piece of a lane lies in one block (block_size >= piece_k = 128 / kBits, checked by the handler);
// the two pieces of a wide lane are 4 piece_k apart, so they may lie in different blocks: each
// piece has its own scale and zero point.
template <typename T, int kBitsT, bool kWideT = false>
struct NbitsWeights {
  static_assert(kBitsT == 4 || kBitsT == 8, "4- or 8-bit weights");
  static constexpr int kBits = kBitsT;
  static constexpr FormatInfo kInfo = Format(kBits, kWideT);
  static constexpr int kPieces = kInfo.pieces;
  static constexpr int kPieceQuads = kInfo.quads / kPieces;  // x quads per 16-byte piece: 4 or 2
  static constexpr bool kPermuteX = kBits == 4;
  static constexpr uint32_t kMidpoint = 1u << (kBits - 1);
  // Blocks a chunk spans, at most (block_size >= piece_k = chunk_k / (4 pieces)).
  static constexpr int kMaxChunkBlocks = MaxChunkBlocks(kBits, kWideT);
  // A ring stage of a warp: W [row g / g + 8][piece][lane][16 bytes], then the tile's scales of the
  // chunk's blocks [block][16 rows] (32 bytes each), then its zero points [block][16 rows].
  static constexpr int kScalesAt = ChunkWeightBytes(kBits, kWideT);
  static constexpr int kStageBytes = StageBytes(kBits, kWideT);
  static_assert(kScalesAt == 2 * kPieces * 32 * 16, "plan.h sizes the chunk");
  static_assert(kInfo.piece_stride * kBits / 8 == 64, "Issue() places a lane's pieces 64 bytes apart");
  static_assert(kScalesAt + kMaxChunkBlocks * (32 + 16) <= kStageBytes, "the chunk's scales and zeros fit");
  static_assert(3 * kMaxChunkBlocks <= 32, "one 16-byte scale / zero-point copy per lane at most");
  // Read() calls per chunk: one per piece (a wide chunk's 2 KB in registers at once would spill
  // at M > 16); each feeds the kPieceQuads quads of its piece.
  static constexpr int kReads = kPieces;
  // One piece of rows g and g + 8, with its scales and zero points.
  struct Chunk {
    uint4 w[2];
    uint32_t scale[2];  // T bits
    uint32_t zero[2];
  };

  // What a lane's copies and reads need that does not change from chunk to chunk, computed once
  // per kernel (per-chunk address math was a large part of the loop). Few registers: the wide
  // M = 32 kernels are at the 128-register cap, and more here made them spill.
  struct Lane {
    int lane;
    int u[kPieces];  // 16 j + g for piece pc's block j of the chunk: row g's scale at
                     // kScalesAt + 2 u (row g + 8: + 16), its zero point at kScalesAt + 32 nb + u
                     // (row g + 8: + 8)
    // The 16 bytes of scales / zero points this lane copies per chunk: block meta_b of the chunk
    // (-1: none); meta_kind 0 / 16: that half (rows 0-7 / 8-15) of the block's scales, 1: its zero
    // points.
    int meta_b, meta_kind;
  };

  // Blocks of a chunk: how many (1 when a block is longer than a chunk).
  __device__ __forceinline__ static int ChunkBlocks(const GemvParams& p) {
    return max(1, kInfo.chunk_k >> p.block_shift);
  }

  // Lanes 0 .. 2 nb - 1 copy 16 bytes of scales each (8 rows of a block), lanes 2 nb .. 3 nb - 1
  // the 16 zero points of a block (when there are zero points).
  __device__ __forceinline__ static Lane MakeLane(const GemvParams& p, int lane) {
    Lane ln;
    const int nb = ChunkBlocks(p), g = lane >> 2, t = lane & 3;
    ln.lane = lane;
#pragma unroll
    for (int pc = 0; pc < kPieces; ++pc) {
      // The piece's block of the chunk (< nb: the piece starts before chunk_k, and when a block is
      // longer than a chunk, before the block's end).
      const int j = (kInfo.lane_stride * t + kInfo.piece_stride * pc) >> p.block_shift;
      ln.u[pc] = 16 * j + g;
    }
    if (lane < 2 * nb) {
      ln.meta_b = lane >> 1;
      ln.meta_kind = (lane & 1) * 16;
    } else {
      ln.meta_b = p.zeros != nullptr && lane < 3 * nb ? lane - 2 * nb : -1;
      ln.meta_kind = 1;
    }
    return ln;
  }

  // Starts copying chunk c of rows `row`, row + 8, and the tile's scales / zero points of the
  // chunk's blocks (MakeLane). Pieces past K (K is a multiple of the block, hence of piece_k: a
  // piece is all in or all out) and blocks past K land as zeros (scale 0).
  __device__ __forceinline__ static void Issue(unsigned char* stage, const GemvParams& p, const Lane& ln,
                                               int row, int c) {
    const int kk = c * kInfo.chunk_k + kInfo.lane_stride * (ln.lane & 3);
    const int64_t row_bytes = int64_t(p.k) * kBits / 8;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row + 8 * h;
      const uint8_t* src = static_cast<const uint8_t*>(p.w) + int64_t(r) * row_bytes + int64_t(kk) * kBits / 8;
#pragma unroll
      for (int pc = 0; pc < kPieces; ++pc) {
        const bool valid = r < p.n_rows && kk + kInfo.piece_stride * pc < p.k;
        CpAsync16(SmemAddr(stage + ((h * kPieces + pc) * 32 + ln.lane) * 16),
                  valid ? static_cast<const void*>(src + 64 * pc) : p.w, valid);
      }
    }
    if (ln.meta_b >= 0) {
      const int tile = row >> 4;  // row = 16 * tile + g
      const int b = ((c * kInfo.chunk_k) >> p.block_shift) + ln.meta_b;
      const bool valid = tile * kMetaTileRows < p.n_rows && b < p.k_blocks;
      const bool zp = ln.meta_kind == 1;
      const int64_t rec = valid ? int64_t(tile) * p.k_blocks + b : 0;
      const uint8_t* src =
          zp ? p.zeros + rec * 16 : static_cast<const uint8_t*>(p.scales) + rec * 32 + ln.meta_kind;
      CpAsync16(SmemAddr(stage + kScalesAt + ln.lane * 16), src, valid);
    }
  }

  // Piece pc of the lane (rows g, g + 8) from a landed stage.
  __device__ __forceinline__ static Chunk Read(const unsigned char* stage, const GemvParams& p,
                                               const Lane& ln, int pc) {
    Chunk ch;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ch.w[h] = *reinterpret_cast<const uint4*>(stage + ((h * kPieces + pc) * 32 + ln.lane) * 16);
      ch.scale[h] = *reinterpret_cast<const unsigned short*>(stage + kScalesAt + 2 * ln.u[pc] + 16 * h);
      const unsigned char* zeros = stage + kScalesAt + 32 * ChunkBlocks(p);  // after nb blocks' scales
      ch.zero[h] = p.zeros != nullptr ? uint32_t(zeros[ln.u[pc] + 8 * h]) : kMidpoint;
    }
    return ch;
  }

  // A registers of quad qi of a piece.
  __device__ __forceinline__ static void Fragments(const Chunk& ch, int qi, uint32_t (&a)[2][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t scale = ch.scale[h];
      const uint32_t s2 = scale | (scale << 16);
      const uint32_t z = ch.zero[h];
      const uint4& w4 = ch.w[h];
      if constexpr (kBits == 4) {
        const uint32_t v = qi == 0 ? w4.x : qi == 1 ? w4.y : qi == 2 ? w4.z : w4.w;
        uint32_t pr[4];  // (e0, e4), (e1, e5), (e2, e6), (e3, e7)
        if constexpr (std::is_same_v<T, __half>) {
          // 0x6400 | n is the f16 1024 + n. Low nibbles: - (1024 + zp). High nibbles land as
          // 1024 + 16 n: * 1/16 - (64 + zp) in one fma (exact: the result is a small integer).
          const uint32_t sub = (0x6400u | z) * 0x10001u;
          const uint32_t add = (0xD400u | (z << 4)) * 0x10001u;  // f16 -(64 + zp)
          const __half2 sixteenth = AsH2<__half>(0x2C002C00u);
          const uint32_t v8 = v >> 8;
          pr[0] = AsU32(__hsub2(AsH2<__half>(AndOr(v, 0x000F000Fu, 0x64006400u)), AsH2<__half>(sub)));
          pr[1] = AsU32(__hfma2(AsH2<__half>(AndOr(v, 0x00F000F0u, 0x64006400u)), sixteenth, AsH2<__half>(add)));
          pr[2] = AsU32(__hsub2(AsH2<__half>(AndOr(v8, 0x000F000Fu, 0x64006400u)), AsH2<__half>(sub)));
          pr[3] = AsU32(__hfma2(AsH2<__half>(AndOr(v8, 0x00F000F0u, 0x64006400u)), sixteenth, AsH2<__half>(add)));
#pragma unroll
          for (int i = 0; i < 4; ++i) pr[i] = AsU32(__hmul2(AsH2<__half>(pr[i]), AsH2<__half>(s2)));
        } else {
          // 0x4300 | n is the bf16 128 + n (7 mantissa bits: nibble by nibble, shifting by 4).
          const uint32_t sub = (0x4300u | z) * 0x10001u;
#pragma unroll
          for (int i = 0; i < 4; ++i) pr[i] = SubMul<T>(AndOr(v >> (4 * i), 0x000F000Fu, 0x43004300u), sub, s2);
        }
        a[0][h] = pr[0];
        a[0][2 + h] = pr[1];
        a[1][h] = pr[2];
        a[1][2 + h] = pr[3];
      } else {
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const int word = 2 * qi + s;
          const uint32_t v = word == 0 ? w4.x : word == 1 ? w4.y : word == 2 ? w4.z : w4.w;
          if constexpr (std::is_same_v<T, __half>) {
            // Bytes into the low mantissa of 0x64XX: the f16 1024 + q (exact up to 255).
            const uint32_t sub = (0x6400u | z) * 0x10001u;
            a[s][h] = SubMul<T>(Prmt(v, 0x64646464u, 0x4140u), sub, s2);
            a[s][2 + h] = SubMul<T>(Prmt(v, 0x64646464u, 0x4342u), sub, s2);
          } else {
            // bf16 cannot hold 128 + q exactly: f32 2^23 + q, minus 2^23 + zp, times the scale,
            // rounded once to bf16.
            const float zf = 8388608.f + float(z);
            const float sf = __uint_as_float(scale << 16);
            float f[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              f[e] = __fmul_rn(__fsub_rn(__uint_as_float(Prmt(v, 0x4B000000u, 0x7440u + e)), zf), sf);
            }
            a[s][h] = AsU32(__floats2bfloat162_rn(f[0], f[1]));
            a[s][2 + h] = AsU32(__floats2bfloat162_rn(f[2], f[3]));
          }
        }
      }
    }
  }
};

}  // namespace joa::gemv
