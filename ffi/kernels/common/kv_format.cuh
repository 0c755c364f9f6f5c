// How an engine reads a KV cache into shared memory, as policy types (like the score variants of
// variant.cuh); the decode engine's cp.async ring uses them, and a tiled prefill engine can.
//
// DenseKv<T>: the cache holds T; tiles stream straight into the ring the MMAs read.
// QuantKv<T, 8>: int8 [B, Hkv, C, D]. QuantKv<T, 4>: uint8 [B, Hkv, C, D / 2] (the layout of
//   kv_quant.cuh, which the writer uses too). Both stream the raw bytes (half / a quarter of a dense
//   tile) through the cp.async ring, so the same shared memory keeps more tiles in flight. Once a
//   tile has landed the CTA converts it into one T tile pair laid out like a dense stage, which the
//   unchanged MMA code reads. A value is T(float(q) * scale), the f32 product rounded once to T, with
//   a scale of 0 read as 1: jax_onnx_attn/ops/reference/quant.dequantize. Scales are f32, one per
//   tensor or one per (KV head, channel).
// QuantRegKv<T, 8 | 4>: the same caches dequantised in registers from the raw ring rows, no T tile
//   (the decode engine's DecodeSplitKernelQRegs, switched on by LaunchOptions::quant_regs).
// DenseCursorKv<T>: DenseKv<T> whose rows are contiguous (row stride D, as decode_attention's
//   caches are), copied through per-thread cursors (the decode engine's LaunchOptions::cursor_loads).
// DenseProducerKv<T>: DenseCursorKv<T>'s copies issued by a producer warp into an mbarrier ring
//   (sm_90; the decode engine's LaunchOptions::producer).
// WideTileKv<Kv>: DenseKv<T> or DenseCursorKv<T> in the decode engine's wide KV tile (kTileRows =
//   plan.h's kWideTileN rows a stage; LaunchOptions::tile128). Every other policy has kTileRows 0:
//   the layout's default tile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/common/kv_quant.cuh"
#include "kernels/common/params.h"
#include "kernels/ptx.cuh"

namespace joa {

// cp.async of rows [0, kRows) of kRowBytes bytes each (row r at src + r * row_stride) to dst, row r
// at dst + r * kPitch: 16-byte copies, or 8 where a row is not whole 16-byte chunks (int4 at D =
// 80: 40 bytes). Rows outside [valid_lo, valid_hi) are zero-filled and not read.
// The copy size of a row of kRowBytes: 16 bytes, or 8 where the row is not whole 16-byte chunks.
constexpr int ByteRowCopy(int row_bytes) { return row_bytes % 16 == 0 ? 16 : 8; }

// One cp.async of kCopy (16 or 8) bytes, zero-filled where !valid.
template <int kCopy>
__device__ __forceinline__ void CpAsyncBytes(uint32_t s, const void* g, bool valid) {
  if constexpr (kCopy == 16) {
    ptx::CpAsync16(s, g, valid);
  } else {
    ptx::CpAsync8(s, g, valid);
  }
}

template <int kRowBytes, int kPitch, int kRows, int kThreads>
__device__ __forceinline__ void LoadByteRows(unsigned char* dst, const unsigned char* src, int64_t row_stride,
                                             int valid_lo, int valid_hi, int tid) {
  constexpr int kCopy = ByteRowCopy(kRowBytes);
  static_assert(kRowBytes % kCopy == 0 && kPitch % kCopy == 0, "rows of whole copies");
  constexpr int kPerRow = kRowBytes / kCopy;
  constexpr int kTotal = kRows * kPerRow;
  constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int c = tid + it * kThreads;
    if (kTotal % kThreads == 0 || c < kTotal) {
      const int r = c / kPerRow;
      const int col = (c % kPerRow) * kCopy;
      const bool valid = r >= valid_lo && r < valid_hi;
      const unsigned char* g = valid ? src + r * row_stride + col : src;
      CpAsyncBytes<kCopy>(ptx::SmemAddr(dst + r * kPitch + col), g, valid);
    }
  }
}

template <typename T>
struct DenseKv {
  static constexpr bool kQuantized = false;
  static constexpr bool kInRegs = false;
  static constexpr bool kCursor = false;
  static constexpr bool kProducer = false;
  static constexpr int kBits = 8 * int(sizeof(T));
  static constexpr int kTileRows = 0;  // the layout's default KV tile (MakeLayout)
};

// A dense cache whose rows are contiguous holds a KV tile as one block of rows * D values, so a
// thread's copies of a tile are its place in the block plus compile-time offsets: no per-copy
// 64-bit stride arithmetic (about 150 SASS instructions a 64-row d64 tile per thread with DenseKv),
// and row tests only in tiles that cross the visible range. Same shared-memory tiles, same bits.
template <typename T>
struct DenseCursorKv : DenseKv<T> {
  static constexpr bool kCursor = true;
};

// A dense cache with contiguous rows whose tiles one producer warp (an extra warp of the CTA) copies
// into a ring of stages guarded by mbarriers, while the other warps only compute (sm_90; the decode
// engine's LaunchOptions::producer): the cursor loads' 16-byte copies by 32 lanes, landing on the
// stage's barrier (cp.async.mbarrier.arrive), so the MMAs read the same tiles and give the same bits.
template <typename T>
struct DenseProducerKv : DenseKv<T> {
  static constexpr bool kProducer = true;
};

// A float cache (DenseKv<T> or DenseCursorKv<T>: Kv's copies) streamed in KV tiles of kTileRows_
// rows instead of the layout's default (the decode engine's wide tile, plan.h kWideTileN: each of
// the 1 x 4 layout's warps takes 32 columns of a 128-row tile in one softmax chunk, so the CTA
// barrier, the softmax reductions and the O rescale come once a 128 rows, not once a 64).
template <class Kv, int kTileRows_>
struct WideTileKv : Kv {
  static_assert(!Kv::kQuantized && !Kv::kProducer, "the wide tile takes the cp.async ring of a float cache");
  static constexpr int kTileRows = kTileRows_;
};

template <typename T, int kBits_>
struct QuantKv {
  using Layout = KvQuantLayout<kBits_ == 8 ? KvFormat::kInt8 : KvFormat::kInt4>;
  static constexpr bool kQuantized = true;
  static constexpr bool kInRegs = false;
  static constexpr bool kCursor = false;
  static constexpr bool kProducer = false;
  static constexpr int kBits = kBits_;
  static constexpr int kTileRows = 0;

  // Bytes of one cache row of kD values (rows are contiguous in the ring, unpadded: only the
  // convert step reads them, with conflict-free consecutive accesses).
  template <int kD>
  static constexpr int RowBytes() { return Layout::template RowBytes<kD>(); }

  // The f32 scales of KV head kvh into s_scale[0, kD) (K) and [kD, 2 kD) (V), 0 read as 1.
  template <int kD, int kThreads>
  static __device__ __forceinline__ void LoadScales(float* s_scale, const KvScales& sc, int kvh, int tid) {
    // Per tensor: every channel reads element 0.
    const int k_step = sc.k_per_channel ? 1 : 0, v_step = sc.v_per_channel ? 1 : 0;
    for (int d = tid; d < kD; d += kThreads) {
      const float ks = sc.k[(kvh * kD + d) * k_step], vs = sc.v[(kvh * kD + d) * v_step];
      s_scale[d] = ScaleOrOne(ks);
      s_scale[kD + d] = ScaleOrOne(vs);
    }
  }

  // cp.async of rows [0, kRows) of K and V (row i at k_src / v_src + i * stride bytes) into a ring
  // stage: K rows then V rows, RowBytes apart; rows outside [valid_lo, valid_hi) are zero-filled
  // and not read.
  template <int kD, int kRows, int kThreads>
  static __device__ __forceinline__ void LoadTile(unsigned char* dst, const unsigned char* k_src,
                                                  const unsigned char* v_src, int64_t k_stride,
                                                  int64_t v_stride, int valid_lo, int valid_hi, int tid) {
    LoadByteRows<RowBytes<kD>(), RowBytes<kD>(), kRows, kThreads>(dst, k_src, k_stride, valid_lo, valid_hi, tid);
    LoadByteRows<RowBytes<kD>(), RowBytes<kD>(), kRows, kThreads>(dst + kRows * RowBytes<kD>(), v_src, v_stride,
                                                 valid_lo, valid_hi, tid);
  }

  // Converts a landed ring stage (src: K rows then V rows) into the T tile pair at dst (K, then V
  // kRows * kStride elements on; row stride kStride, the 16-byte chunks of row r XOR-ed with r % 8
  // where kSwizzle: a dense stage's layout, the decode engine's TileElem). Rows outside
  // [valid_lo, valid_hi) become zeros, as the dense loads zero-fill them. A thread keeps one
  // 8-column slice (so its 16 scales are read once) and walks the rows.
  template <int kD, int kRows, int kThreads, int kStride, bool kSwizzle>
  static __device__ __forceinline__ void ConvertTile(T* dst, const unsigned char* src,
                                                     const float* s_scale, int valid_lo,
                                                     int valid_hi, int tid) {
    constexpr int kSlices = kD / 8;                       // 8 values -> one 16-byte store of T
    constexpr int kRowStep = kThreads / kSlices;          // rows converted side by side
    static_assert(kRowStep >= 1, "a thread per 8-column slice of a row");
    constexpr int kIters = (kRows + kRowStep - 1) / kRowStep;
    constexpr int kSliceBytes = Layout::kBytes8;
    // D 80 / 96: 128 or 256 threads are not whole rows of slices; the remainder idles.
    if (kThreads % kSlices != 0 && tid >= kRowStep * kSlices) return;
    const int slice = tid % kSlices, r0 = tid / kSlices;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      float sc[8];
      const float4* s4 = reinterpret_cast<const float4*>(s_scale + kv * kD + slice * 8);
      const float4 s_lo = s4[0], s_hi = s4[1];
      sc[0] = s_lo.x; sc[1] = s_lo.y; sc[2] = s_lo.z; sc[3] = s_lo.w;
      sc[4] = s_hi.x; sc[5] = s_hi.y; sc[6] = s_hi.z; sc[7] = s_hi.w;
      const unsigned char* s = src + kv * kRows * RowBytes<kD>() + slice * kSliceBytes;
      T* d = dst + kv * kRows * kStride;
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        const int r = r0 + i * kRowStep;
        if (kRows % kRowStep == 0 || r < kRows) {
          uint4 y = make_uint4(0u, 0u, 0u, 0u);
          if (r >= valid_lo && r < valid_hi) y = Dequant8(s + r * RowBytes<kD>(), sc);
          *reinterpret_cast<uint4*>(d + TileElem(kSwizzle, kStride, r, slice)) = y;
        }
      }
    }
  }


  // 8 consecutive values of one row at raw (8 bytes int8 / 4 bytes int4) -> 8 T in one uint4,
  // each T(float(q) * sc[c]).
  static __device__ __forceinline__ uint4 Dequant8(const unsigned char* raw, const float (&sc)[8]) {
    float x[8];
    Layout::Load8(raw, x);
    uint4 y;
    y.x = ptx::Pack2<T>(x[0] * sc[0], x[1] * sc[1]);
    y.y = ptx::Pack2<T>(x[2] * sc[2], x[3] * sc[3]);
    y.z = ptx::Pack2<T>(x[4] * sc[4], x[5] * sc[5]);
    y.w = ptx::Pack2<T>(x[6] * sc[6], x[7] * sc[7]);
    return y;
  }
};

// QuantRegKv<T, 8 | 4>: the same caches, dequantised in registers (the decode engine's
// DecodeSplitKernelQRegs, engine_qregs.cuh). The raw bytes land in the ring with padded row pitches
// (KPitch / VPitch: the fragment loads below are bank-conflict free) and each warp builds its MMA B
// fragments from the packed words it reads: no T tile, no second shared-memory pass, no barrier per
// tile. Exact integers go into the MMAs as f16 whatever T is (MmaT: every int8 / int4 level is an
// f16, and f16's magic-number conversions take 2-3 instructions a pair where bf16's int8 takes ~5
// through f32 and its int4 one more shift); the engine stages Q in f16 under a power-of-two scale
// per row and rounds P to f16. The scales are applied where they factor out (the engine: K per
// tensor and Q's row scale on the logits, K per channel on Q once per CTA, V on the f32 O columns).
//
// Fragment maps (m16n8k16, lane = 4 g + t):
//   Q K^T: the reduction runs over channels, whose order is free as long as Q's A fragment uses the
//   same one, so the engine permutes Q once per CTA and a lane reads whole words of one K row
//   (n = g): KChan(kk, t, h, e) is the channel behind k index 2t + e + 8h of k step kk.
//   P V: the reduction runs over KV rows (identity: P comes from the score accumulators); the output
//   channel order is free, undone when O is staged for the merge: VChan(dt, col) is the channel of
//   column col of O n8 tile dt. A lane reads for its column g a word of W / 8 consecutive channels
//   (W = 32 int8, 64 int4; a narrower tail segment at D 80 / 96) of rows 2t, 2t + 1, 2t + 8, 2t + 9.
template <typename T, int kBits_>
struct QuantRegKv {
  using Layout = KvQuantLayout<kBits_ == 8 ? KvFormat::kInt8 : KvFormat::kInt4>;
  using Base = QuantKv<T, kBits_>;
  static constexpr bool kQuantized = true;
  static constexpr bool kInRegs = true;
  static constexpr bool kCursor = false;
  static constexpr bool kProducer = false;
  static constexpr int kBits = kBits_;
  static constexpr int kTileRows = 0;
  using MmaT = __half;  // the MMAs' operand type (levels, Q', P), for f16 and bf16 caches alike

  template <int kD>
  static constexpr int RowBytes() { return Layout::template RowBytes<kD>(); }

  // --- channel maps (host and device: the CPU test emulates them) ---------------------------------

  // Whether k step kk is the 16-channel tail of a head dim that is not whole 32-channel groups.
  static constexpr bool IsTail(int d, int kk) { return d % 32 != 0 && kk == d / 16 - 1; }
  // The channel behind k index 2t + e + 8h of k step kk (the K B fragment's and Q's A fragment's).
  static constexpr int KChan(int d, int kk, int t, int h, int e) {
    return IsTail(d, kk) ? 16 * kk + 4 * t + h + 2 * e
           : kBits == 8  ? 32 * (kk / 2) + 8 * t + 4 * (kk & 1) + h + 2 * e
                         : 32 * (kk / 2) + 8 * t + 2 * (kk & 1) + h + 4 * e;
  }
  // V channel segments: widths kVW as long as they fit, then halves (D 80 / 96).
  static constexpr int kVW = kBits == 8 ? 32 : 64;
  static constexpr int SegW(int d, int start) {
    int w = kVW;
    while (start + w > d) w /= 2;
    return w;
  }
  static constexpr int NumSegs(int d) {
    int n = 0;
    for (int s = 0; s < d; s += SegW(d, s)) ++n;
    return n;
  }
  static constexpr int SegStart(int d, int i) {
    int s = 0;
    for (int j = 0; j < i; ++j) s += SegW(d, s);
    return s;
  }
  // The channel of column col of O n8 tile dt.
  static constexpr int VChan(int d, int dt, int col) {
    int s = 0;
    while (s + SegW(d, s) <= 8 * dt) s += SegW(d, s);
    return s + (SegW(d, s) / 8) * col + (dt - s / 8);
  }

  // --- load ------------------------------------------------------------------------------------

  template <int kD, int kThreads>
  static __device__ __forceinline__ void LoadScales(float* s_scale, const KvScales& sc, int kvh, int tid) {
    Base::template LoadScales<kD, kThreads>(s_scale, sc, kvh, tid);
  }

  // cp.async of rows [0, kRows) of K and V into a ring stage: K rows kKPitch bytes apart, then V
  // rows kVPitch apart; rows outside [valid_lo, valid_hi) are zero-filled and not read (a zero
  // int4 byte reads as -8: finite, and such rows are masked, so their P is 0).
  template <int kD, int kRows, int kThreads, int kKPitch, int kVPitch>
  static __device__ __forceinline__ void LoadTile(unsigned char* dst, const unsigned char* k_src,
                                                  const unsigned char* v_src, int64_t k_stride,
                                                  int64_t v_stride, int valid_lo, int valid_hi, int tid) {
    static_assert(kKPitch % 16 == 0 && kVPitch % 16 == 0, "fragment loads need 16-byte row pitches");
    LoadByteRows<RowBytes<kD>(), kKPitch, kRows, kThreads>(dst, k_src, k_stride, valid_lo, valid_hi, tid);
    LoadByteRows<RowBytes<kD>(), kVPitch, kRows, kThreads>(dst + kRows * kKPitch, v_src, v_stride,
                                                       valid_lo, valid_hi, tid);
  }

  // LoadTile's copies for rows one after another (stride = the row's bytes, as the decode handler
  // lays out every quantised cache; Launch checks): kRows rows of each tile, tiles kTileRows rows
  // apart, by kThreads threads (a CTA, or one warp copying the rows it reads). Those rows are one
  // block, so a thread's copies are its place in the block plus compile-time offsets, from cursors
  // that move a tile per Load (tiles are loaded in order). A tile the visible range covers copies
  // without row tests or 64-bit row arithmetic (LoadByteRows spends ~15 SASS instructions a copy on
  // it); the first and last tiles of a split take LoadByteRows. The same bytes land where LoadTile
  // puts them.
  template <int kD, int kRows, int kTileRows, int kThreads, int kKPitch, int kVPitch>
  struct TileStream {
    static constexpr int kRowBytes = RowBytes<kD>();
    static constexpr int kCopy = ByteRowCopy(kRowBytes);
    static constexpr int kPerRow = kRowBytes / kCopy;
    static constexpr int kTotal = kRows * kPerRow;
    static constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
    static constexpr int64_t kTileBytes = int64_t(kTileRows) * kRowBytes;
    const unsigned char* k;  // the thread's first copy in the next tile's K rows
    const unsigned char* v;

    // k_rows / v_rows: the first row this stream copies of tile 0; t: the first tile to load.
    __device__ __forceinline__ TileStream(const unsigned char* k_rows, const unsigned char* v_rows, int t,
                                          int tid)
        : k(k_rows + t * kTileBytes + tid * kCopy), v(v_rows + t * kTileBytes + tid * kCopy) {}

    // The next tile's rows into dst_k / dst_v (row pitches kKPitch / kVPitch); rows outside
    // [valid_lo, valid_hi) (counted from the stream's first row) zero-filled and not read.
    __device__ __forceinline__ void Load(unsigned char* dst_k, unsigned char* dst_v, int valid_lo, int valid_hi,
                                         int tid) {
      if (valid_lo <= 0 && valid_hi >= kRows) {
        const uint32_t base_k = ptx::SmemAddr(dst_k), base_v = ptx::SmemAddr(dst_v);
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
          const int c = tid + it * kThreads;
          if (kTotal % kThreads == 0 || c < kTotal) {
            const int r = c / kPerRow, col = (c % kPerRow) * kCopy;
            CpAsyncBytes<kCopy>(base_k + uint32_t(r * kKPitch + col), k + it * kThreads * kCopy, true);
            CpAsyncBytes<kCopy>(base_v + uint32_t(r * kVPitch + col), v + it * kThreads * kCopy, true);
          }
        }
      } else {
        const unsigned char* k0 = k - tid * kCopy;  // the tile's first row of this stream
        const unsigned char* v0 = v - tid * kCopy;
        LoadByteRows<kRowBytes, kKPitch, kRows, kThreads>(dst_k, k0, kRowBytes, valid_lo, valid_hi, tid);
        LoadByteRows<kRowBytes, kVPitch, kRows, kThreads>(dst_v, v0, kRowBytes, valid_lo, valid_hi, tid);
      }
      k += kTileBytes;
      v += kTileBytes;
    }
  };

  // --- dequantisation in registers -----------------------------------------------------------

  // Two 4-bit levels (stored q + 8) -> an f16 pair (lo, hi), exact, two instructions. I4Lo takes
  // the nibbles at bits [0, 4) and [16, 20): dropped into the mantissa of 1024, minus 1032 (LOP3,
  // HSUB2). I4Hi takes those at [4, 8) and [20, 24) without a shift: 1024 + 16 n, times 1/16 minus
  // 72 (LOP3, HFMA2; 64 + n is exact, so one rounding of an exact value).
  static __device__ __forceinline__ uint32_t I4Lo(uint32_t x) {
    const uint32_t y = ptx::AndOr(x, 0x000F000Fu, 0x64006400u);
    return Bits<uint32_t>(__hsub2(Bits<__half2>(y), Bits<__half2>(0x64086408u)));
  }
  static __device__ __forceinline__ uint32_t I4Hi(uint32_t x) {
    const uint32_t y = ptx::AndOr(x, 0x00F000F0u, 0x64006400u);
    // 0x2C00 = 1/16, 0xD480 = -72
    return Bits<uint32_t>(__hfma2(Bits<__half2>(y), Bits<__half2>(0x2C002C00u), Bits<__half2>(0xD480D480u)));
  }

  // Two int8 levels, bytes 0 and 2 of x (the other two are masked off) -> an f16 pair, exact: the
  // biased byte q + 128 in the mantissa of 1024, minus 1152.
  static __device__ __forceinline__ uint32_t I8Pair(uint32_t x) {
    const uint32_t y = ptx::AndXor(x, 0x00FF00FFu, 0x64806480u);
    return Bits<uint32_t>(__hsub2(Bits<__half2>(y), Bits<__half2>(0x64806480u)));
  }

  // The K B fragments of one K row for k steps 2 kp and 2 kp + 1 (b[0..1] and b[2..3]), from the
  // row's bytes at row (a whole 32-channel group per lane quad; KChan's paired maps).
  template <int kD>
  static __device__ __forceinline__ void KPair(uint32_t (&b)[4], const unsigned char* row, int kp, int t) {
    if constexpr (kBits == 8) {
      const uint2 w = *reinterpret_cast<const uint2*>(row + 32 * kp + 8 * t);
      b[0] = I8Pair(w.x);       // channels (0, 2): k 2t, 2t + 1
      b[1] = I8Pair(w.x >> 8);  // (1, 3): k 2t + 8, 2t + 9
      b[2] = I8Pair(w.y);       // (4, 6)
      b[3] = I8Pair(w.y >> 8);  // (5, 7)
    } else {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(row + 16 * kp + 4 * t);
      b[0] = I4Lo(w);        // nibbles (0, 4)
      b[1] = I4Hi(w);        // (1, 5)
      b[2] = I4Lo(w >> 8);   // (2, 6)
      b[3] = I4Hi(w >> 8);   // (3, 7)
    }
  }

  // The K B fragment of the 16-channel tail step kk (channels 16 kk + 4t + {0, 2} and {1, 3}).
  static __device__ __forceinline__ void KTail(uint32_t (&b)[2], const unsigned char* row, int kk, int t) {
    if constexpr (kBits == 8) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(row + 16 * kk + 4 * t);
      b[0] = I8Pair(w);
      b[1] = I8Pair(w >> 8);
    } else {
      const uint32_t h = *reinterpret_cast<const uint16_t*>(row + 8 * kk + 2 * t);
      const uint32_t x = __byte_perm(h, 0u, 0x4140u);  // byte 1 -> byte 2
      b[0] = I4Lo(x);
      b[1] = I4Hi(x);
    }
  }

  // kNb bytes (4, 2 or 1) of a row at p as the low bytes of a word.
  template <int kNb>
  static __device__ __forceinline__ uint32_t LoadWord(const unsigned char* p) {
    if constexpr (kNb == 4) return *reinterpret_cast<const uint32_t*>(p);
    else if constexpr (kNb == 2) return *reinterpret_cast<const uint16_t*>(p);
    else return *p;
  }

  // A lane's words of the V segment [kStart, kStart + kW) from its 4 rows: the kW / 8 channels of
  // its column g (PvSegment's and PvSegmentKeyRows' loads).
  template <int kStart, int kW>
  static __device__ __forceinline__ void LoadVWords(uint32_t (&w)[4], const unsigned char* const (&rows)[4], int g) {
    constexpr int kNb = kW / 8 * kBits / 8;  // bytes of a lane's channels
    constexpr int kOff = kStart * kBits / 8;
#pragma unroll
    for (int r = 0; r < 4; ++r) w[r] = LoadWord<kNb>(rows[r] + kOff + kNb * g);
  }

  // O += P V over the V segment [kStart, kStart + kW) of one k16 step: rows[0..3] point at KV rows
  // 2t, 2t + 1, 2t + 8, 2t + 9 of the step (g: the lane's column).
  template <int kD, int kStart, int kW, int kNt>
  static __device__ __forceinline__ void PvSegment(float (&o)[kNt][4], const uint32_t (&pa)[4],
                                                   const unsigned char* const (&rows)[4], int g) {
    constexpr int kCh = kW / 8;              // channels a lane holds
    uint32_t w[4];
    LoadVWords<kStart, kW>(w, rows, g);
    // Channel i of a word is byte i / 2 (int8: i) of it; byte_perm gathers that byte of the two
    // rows of a B register into bytes 0 and 2.
    if constexpr (kBits == 8) {
#pragma unroll
      for (int i = 0; i < kCh; ++i) {
        const unsigned sel = unsigned(i | ((4 + i) << 8));
        ptx::Mma16816<MmaT>(o[kStart / 8 + i], pa, I8Pair(__byte_perm(w[0], w[1], sel)),
                            I8Pair(__byte_perm(w[2], w[3], sel)));
      }
    } else {
#pragma unroll
      for (int i2 = 0; i2 < kCh / 2; ++i2) {
        const unsigned sel = unsigned(i2 | ((4 + i2) << 8));
        const uint32_t x0 = __byte_perm(w[0], w[1], sel), x1 = __byte_perm(w[2], w[3], sel);
        ptx::Mma16816<MmaT>(o[kStart / 8 + 2 * i2], pa, I4Lo(x0), I4Lo(x1));
        ptx::Mma16816<MmaT>(o[kStart / 8 + 2 * i2 + 1], pa, I4Hi(x0), I4Hi(x1));
      }
    }
  }

  // PvSegment with keys as the MMA's k and channels as its rows (the register kernel's key-rows
  // form, key_rows.cuh: O^T += V^T P^T, pb P^T's B fragment): the B fragments PvSegment builds for
  // O n8 tiles 2i and 2i + 1 of the segment are the A fragment of O^T m16 tile i (its rows g and
  // g + 8 are those tiles' column g: VChan(d, 2 i, g), VChan(d, 2 i + 1, g)). Same unpack.
  template <int kD, int kStart, int kW, int kMt>
  static __device__ __forceinline__ void PvSegmentKeyRows(float (&o)[kMt][4], const uint32_t (&pb)[2],
                                                          const unsigned char* const (&rows)[4], int g) {
    constexpr int kCh = kW / 8;
    static_assert(kCh % 2 == 0, "a segment is whole m16 tiles");
    uint32_t w[4];
    LoadVWords<kStart, kW>(w, rows, g);
#pragma unroll
    for (int i2 = 0; i2 < kCh / 2; ++i2) {
      uint32_t a[4];
      if constexpr (kBits == 8) {
        const unsigned s0 = unsigned(2 * i2 | ((4 + 2 * i2) << 8)), s1 = unsigned((2 * i2 + 1) | ((5 + 2 * i2) << 8));
        a[0] = I8Pair(__byte_perm(w[0], w[1], s0));
        a[1] = I8Pair(__byte_perm(w[0], w[1], s1));
        a[2] = I8Pair(__byte_perm(w[2], w[3], s0));
        a[3] = I8Pair(__byte_perm(w[2], w[3], s1));
      } else {
        const unsigned sel = unsigned(i2 | ((4 + i2) << 8));
        const uint32_t x0 = __byte_perm(w[0], w[1], sel), x1 = __byte_perm(w[2], w[3], sel);
        a[0] = I4Lo(x0);
        a[1] = I4Hi(x0);
        a[2] = I4Lo(x1);
        a[3] = I4Hi(x1);
      }
      ptx::Mma16816<MmaT>(o[kStart / 16 + i2], a, pb[0], pb[1]);
    }
  }

 private:
  template <typename To, typename From>
  static __device__ __forceinline__ To Bits(const From& x) {
    static_assert(sizeof(To) == sizeof(From), "same size");
    To y;
    memcpy(&y, &x, sizeof(To));
    return y;
  }
};

// The policy of a KvFormat (params.h).
template <typename T, KvFormat kFormat>
struct KvPolicyOf;
template <typename T>
struct KvPolicyOf<T, KvFormat::kDense> {
  using type = DenseKv<T>;
};
template <typename T>
struct KvPolicyOf<T, KvFormat::kInt8> {
  using type = QuantKv<T, 8>;
};
template <typename T>
struct KvPolicyOf<T, KvFormat::kInt4> {
  using type = QuantKv<T, 4>;
};
template <typename T, KvFormat kFormat>
using KvPolicy = typename KvPolicyOf<T, kFormat>::type;

}  // namespace joa
