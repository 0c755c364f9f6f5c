// Keys as the MMA rows (LaunchOptions::key_rows): a decode block of at most kKeyRowsMaxRows query
// rows in one warp row puts the keys in the 16 rows of every m16n8k16 MMA and the query rows in its
// 8 columns:
//   QK   S^T = K Q^T     A: K (16 keys x 16 channels), B: Q's rows, kept in registers;
//   PV   O^T += V^T P^T  A: V transposed (16 channels x 16 keys), B: P^T, the score tile's halves
//                        transposed in registers (movmatrix).
// As the MMA's rows a decode block's query rows are 1/4 of it (4 at 32/8 heads), as its columns 1/2:
// half the MMAs, half the score elements a lane (scale, masks, exp2) and half the O accumulators
// (and their rescale). The fragments are the query-rows form's in another order (for a quantised
// cache, the same unpack). The register kernel's key-rows form (engine_qregs.cuh) runs on these.
// (A float cache's kernel in this form, its ldmatrix loads with each operand taking the other's
// lane offsets, was as fast as its query-rows form at B=1 2k-128k and B=8 16k on the H200: it is
// not bound by its instructions there; session 30, docs/kernels.md.)
//
// Layouts (lane = 4 g + t): a chunk's S^T, element e of key tile kt: key 16 kt + g + 8 (e >> 1),
// query row 2t + (e & 1); O^T, element e of m16 tile mt: channel row g + 8 (e >> 1) of the tile
// (the kernel's channel map), query row 2t + (e & 1). A lane's running max m and sum l are those of
// its query rows 2t and 2t + 1; the 8 lanes of a column hold the same max and partial sums.
#pragma once

#include <cstdint>

#include "kernels/ptx.cuh"

namespace joa::decode {

// Query rows a key-rows block takes: the MMA's 8 columns.
inline constexpr int kKeyRowsMaxRows = 8;

struct KeyRows {
  // Q rows 0-7 of the block (kStride elements apart) as the B fragments of every k16 step: qb[kk] =
  // elements 16 kk + 2t, + 1 and 16 kk + 8 + 2t, + 1 of row g.
  template <int kD, int kStride, typename T>
  static __device__ __forceinline__ void LoadQ(uint32_t (&qb)[kD / 16][2], const T* s_q, int lane) {
    const uint32_t addr = ptx::SmemAddr(s_q + (lane & 7) * kStride + (lane >> 3) * 8);
#pragma unroll
    for (int kp = 0; kp < kD / 32; ++kp) {
      uint32_t r[4];
      ptx::LdMatrixX4(r, addr + kp * 64);
      qb[2 * kp][0] = r[0];
      qb[2 * kp][1] = r[1];
      qb[2 * kp + 1][0] = r[2];
      qb[2 * kp + 1][1] = r[3];
    }
    if constexpr (kD % 32 != 0) ptx::LdMatrixX2(qb[kD / 16 - 1], addr + (kD / 16 - 1) * 32);
  }

  // The online softmax over a chunk, per query column: the max over the keys of the column's 8
  // lanes, s -> exp2(s - m), the lane's running sum l, the rescale of O. One branch for both
  // columns: a column whose max stayed has corr exactly 1.
  template <int kKeyTiles, int kMt>
  static __device__ __forceinline__ void Softmax(float (&s)[kKeyTiles][4], float (&m)[2], float (&l)[2],
                                                 float (&o)[kMt][4]) {
    float corr[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float mx = fmaxf(s[0][c], s[0][2 + c]);
#pragma unroll
      for (int kt = 1; kt < kKeyTiles; ++kt) mx = fmaxf(mx, fmaxf(s[kt][c], s[kt][2 + c]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m[c], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no visible key yet: exp2 stays 0
      corr[c] = ptx::Exp2(m[c] - m_use);
      m[c] = m_new;
#pragma unroll
      for (int kt = 0; kt < kKeyTiles; ++kt) {
        s[kt][c] = ptx::Exp2(s[kt][c] - m_use);
        s[kt][2 + c] = ptx::Exp2(s[kt][2 + c] - m_use);
      }
      float sum = s[0][c] + s[0][2 + c];
#pragma unroll
      for (int kt = 1; kt < kKeyTiles; ++kt) sum += s[kt][c] + s[kt][2 + c];
      l[c] = l[c] * corr[c] + sum;
    }
    if (corr[0] != 1.f || corr[1] != 1.f) {
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        o[mt][0] *= corr[0];
        o[mt][1] *= corr[1];
        o[mt][2] *= corr[0];
        o[mt][3] *= corr[1];
      }
    }
  }

  // P^T's B fragment of one key tile (keys g / g + 8 x queries 2t, 2t + 1 -> queries g x keys
  // 2t, 2t + 1 / 2t + 8, 2t + 9), the probabilities rounded to the MMA's type.
  template <typename MmaT>
  static __device__ __forceinline__ void Pt(uint32_t (&pb)[2], const float (&s)[4]) {
    pb[0] = ptx::MovMatrixTrans(ptx::Pack2<MmaT>(s[0], s[1]));
    pb[1] = ptx::MovMatrixTrans(ptx::Pack2<MmaT>(s[2], s[3]));
  }

  // A warp's max and sum of its query rows 0-7 into the merge rows (s_m / s_l: 16 a warp; the merge
  // reads no row past the block's, kKeyRowsMaxRows at most), by one lane of each column.
  static __device__ __forceinline__ void StageStats(const float (&m)[2], const float (&l)[2], float* s_m,
                                                    float* s_l, int warp, int lane) {
    if (lane < 4) {
      s_m[warp * 16 + 2 * lane] = m[0];
      s_m[warp * 16 + 2 * lane + 1] = m[1];
      s_l[warp * 16 + 2 * lane] = l[0];
      s_l[warp * 16 + 2 * lane + 1] = l[1];
    }
  }

  // The lane's running sums reduced over its column's 8 lanes.
  static __device__ __forceinline__ void ReduceSums(float (&l)[2]) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      l[c] += __shfl_xor_sync(0xffffffffu, l[c], 4);
      l[c] += __shfl_xor_sync(0xffffffffu, l[c], 8);
      l[c] += __shfl_xor_sync(0xffffffffu, l[c], 16);
    }
  }
};

}  // namespace joa::decode
