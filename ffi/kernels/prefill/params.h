// The prefill engine (Hopper flash attention): its parameters and static tiling. Host-only C++.
//
// Layout (the decode engine's): q [B, Hq, S, D], k / v [B, Hkv, T, D], y [B, Hq, S, D], all dense,
// f16 or bf16. GQA packing: the G = Hq / Hkv query heads of KV head kvh are packed as rows
// r = g * S + i of one [G * S, D] block (rows bh * G * S + r of q viewed as [B * Hq * S, D],
// bh = b * Hkv + kvh), so one CTA's query rows share every K / V tile it loads.
//
// Batch row b has q_len[b] valid query rows and kv_len[b] valid keys (int32 [B], read on the
// device, clamped to [0, S] and [0, T]); query row i < q_len[b] sits at position
// kv_len[b] - q_len[b] + i (bottom-right aligned) and, causal, sees keys j <= its position. Rows
// i >= q_len[b] and rows that see no key are written as zeros. Windows (variant.left / right >= 0)
// hide keys j with pos - j > left or j - pos > right; Bounds skips the tiles outside every row's
// window and tiles inside every row's window take the unmasked softmax.
#pragma once

#include <cstdint>

#include "kernels/common/params.h"

namespace joa::prefill {

struct PrefillParams {
  void* y;
  const int32_t* q_len;   // [B]
  const int32_t* kv_len;  // [B]
  int batch, q_heads, kv_heads, q_rows, kv_rows, head_dim;  // B, Hq, Hkv, S, T, D
  int group;  // G = Hq / Hkv
  int rows;   // M = G * S packed rows per KV head
  int m_blocks;  // ceil(M / the tiling's block_m)
  // The variant: scale, causal, windows left / right (kernels/common/variant.cuh's MaskVariant reads
  // it), softcap (> 0: the CapVariant kernels) and sink (f32 [Hq] or null: engine.cuh's WithSink
  // kernels). pos_shift and bias are unused here.
  VariantParams variant;
  // Split-KV (plan.h): each (b, kvh, m-block)'s key tiles cut into `splits` fixed ranges, one CTA
  // each. 1: the CTA writes y as it always did. > 1: it writes its rows' normalised f32 partial O
  // and log2-sum-exp into part_o [B, Hkv, splits, M, D] / part_lse [B, Hkv, splits, M] (the
  // workspace), and combine.cuh merges them into y.
  int splits;
  float* part_o;
  float* part_lse;
};

// CTA tile: kBlockM packed query rows (two consumer warpgroups of 64) x a head size's key tile
// (Tiling::block_n keys per step); kTuneM192's tiling takes 192 rows (three consumers).
inline constexpr int kBlockM = 128;
inline constexpr int kConsumers = 2;             // consumer warpgroups
inline constexpr int kThreads = 128 * (1 + kConsumers);  // + one producer warpgroup
inline constexpr int kHeadDims[] = {64, 80, 96, 128, 256};

// How the two consumer warpgroups order their work on a key tile (engine.cuh, Consume). All three
// add in the same order: the same bits. Names for Python (_ffi.limits(), indexed by the value).
//   kSerial:   Q K^T, softmax, P V one after another.
//   kOverlap:  Q K^T of tile n + 1 and P V of tile n in flight during the softmax of tile n + 1
//              (FA3's intra-warpgroup pipelining).
//   kPingPong: kOverlap, and the two warpgroups take turns to issue their tensor-core work, so one
//              runs its softmax while the other's MMAs run (FA3's ping-pong, named barriers).
enum class Schedule : int { kSerial = 0, kOverlap = 1, kPingPong = 2 };

// Main-loop tunings (issue 14), bits of a kernel template parameter, opt-in through the named
// schedules below so that the bench can A/B them in one process; the plain schedules (tune 0) are
// the kernels as they were, instruction for instruction.
//   kTuneFold:  the scale folded into the exp2 argument, FA3's way: the row max is taken on the raw
//               Q K^T scores and P = ex2(s * scale_log2 - max * scale_log2) is one FFMA and one MUFU
//               per element (was FMUL score, FSUB, MUFU). Changes bits (a fused multiply-add rounds
//               once); needs scale > 0 (max commutes with the scaling), else the launch drops it.
//   kTuneLazy:  the O rescale (64 FMUL a thread and tile at D 128, 32 at D 64) skipped when no row
//               of the warp changed its max (every alpha exactly 1: x * 1 is exact), a warp vote and
//               a uniform branch. Keeps the bits.
//   kTuneWideN: 176 keys per step at D 128 (FA3's non-causal tile; 2 stages, 209 KB of shared
//               memory): 11 / 8 of the work per softmax round, S / P 88 + 44 registers a thread.
//               Keeps each element's arithmetic but changes the order of the row sums: other bits.
//   kTuneN192:  192 keys per step at D 64 (FA3's hdim-64 non-causal tile): a step at D 64 is half
//               the tensor-core work of one at D 128 for the same softmax, so the fixed costs of a
//               step (row-max shuffles, alphas, barrier waits, turns) weigh twice; 3 / 2 of the keys
//               per step spreads them. S / P / O 96 + 48 + 32 registers a thread. Other bits (row-sum
//               order).
//   kTuneDeepKV: 4 K / V stages at D 64 instead of 2 (the plain D 64 tiling uses 80 of the 227 KB a
//               CTA may have and one CTA runs per SM anyway: the registers): a D 64 step is short, so
//               2 stages hide less of a load's latency. Keeps the bits (the ring's depth orders no
//               arithmetic).
//   kTuneM192:  192 query rows a CTA at D 64, three consumer warpgroups taking turns (FA3's hdim-64
//               tile): while one issues its MMAs two run their softmax, where two warpgroups leave
//               the tensor cores idle whenever a softmax outlasts the other's MMAs (at D 64 it does:
//               half the MMA work of D 128 per step, the same softmax). 160 registers a consumer
//               (S / P / O 64 + 32 + 32), 24 the producer. Each row's arithmetic is the 128-row
//               tile's: the same bits.
// Each tune is compiled with the plain MaskVariant only, at the head sizes TuneCompiled names; a
// tuned schedule called at another head size, with sinks or softcap runs its base schedule's kernel
// (same results, no tuning).
enum Tune : int {
  kTuneNone = 0, kTuneFold = 1, kTuneLazy = 2, kTuneWideN = 4, kTuneN192 = 8, kTuneDeepKV = 16, kTuneM192 = 32
};

// Whether the tuned kernel of `tune` is compiled at head size d: fold and lazy at D 64 and 128 (the
// head sizes the bench's targets name), each tiling bit at the one head size it is sized for.
constexpr bool TuneCompiled(int d, int tune) {
  const bool tiling_fits =
      (!(tune & kTuneWideN) || d == 128) && (!(tune & (kTuneN192 | kTuneDeepKV | kTuneM192)) || d == 64);
  return tune != kTuneNone && (d == 64 || d == 128) && tiling_fits;
}

// The schedules callers name (the handler's `schedule` attribute is an index of this list; Python's
// cuda.PREFILL_SCHEDULES reads the names through _ffi.limits()).
struct ScheduleSpec {
  Schedule base;
  int tune;
};
inline constexpr ScheduleSpec kScheduleSpecs[] = {
    {Schedule::kSerial, kTuneNone},
    {Schedule::kOverlap, kTuneNone},
    {Schedule::kPingPong, kTuneNone},
    {Schedule::kPingPong, kTuneFold},
    {Schedule::kPingPong, kTuneLazy},
    {Schedule::kPingPong, kTuneFold | kTuneLazy},
    {Schedule::kPingPong, kTuneWideN},
    {Schedule::kPingPong, kTuneFold | kTuneLazy | kTuneWideN},
    {Schedule::kPingPong, kTuneFold | kTuneLazy | kTuneDeepKV},
    {Schedule::kPingPong, kTuneN192},
    {Schedule::kPingPong, kTuneFold | kTuneLazy | kTuneN192},
    {Schedule::kPingPong, kTuneFold | kTuneLazy | kTuneN192 | kTuneDeepKV},
    {Schedule::kPingPong, kTuneFold | kTuneLazy | kTuneM192},
    {Schedule::kPingPong, kTuneFold | kTuneLazy | kTuneM192 | kTuneDeepKV},
};
inline constexpr const char* kScheduleNames[] = {"serial",        "overlap",       "pingpong",
                                                 "pingpong-fold", "pingpong-lazy", "pingpong-fold-lazy",
                                                 "pingpong-n176", "pingpong-fold-lazy-n176",
                                                 "pingpong-fold-lazy-s4", "pingpong-n192",
                                                 "pingpong-fold-lazy-n192", "pingpong-fold-lazy-n192-s4",
                                                 "pingpong-fold-lazy-m192", "pingpong-fold-lazy-m192-s4"};
inline constexpr int kNumSchedules = int(sizeof(kScheduleNames) / sizeof(kScheduleNames[0]));
static_assert(sizeof(kScheduleSpecs) / sizeof(kScheduleSpecs[0]) == kNumSchedules, "one spec per name");

// The static tiling of one head size d, the one source of truth (engine.cuh's Smem and the kernels,
// the launch, the handler's checks and _ffi.limits() all read it):
//   padded:  the width of the shared-memory tiles and of O (a multiple of 64: whole 128-byte
//            swizzled [rows][64] column blocks). 80 and 96 run in the 128-wide tiles: the TMA fills
//            the columns past d with zeros, Q K^T runs only ceil(d / 16) k-steps, P V computes the
//            128 columns (those past d are 0) and the epilogue writes d.
//   block_n: keys per step (K / V tile rows, a multiple of 16). 256: 80 (FA3's choice for its
//            hdim 256: a 64 x 256 f32 O is 128 registers a consumer thread, and 2 stages of 80-row
//            K and V tiles with the 64 KB Q tile are 224 KB of the 227 KB a CTA may have).
//   stages:  K / V shared-memory ring depth.
//   block_m: packed query rows a CTA, 64 per consumer warpgroup (kBlockM but under kTuneM192).
//   schedule: the default of calls that name none (cuda.prefill_attention, the routes), an index of
//            kScheduleSpecs: at 128 pingpong-fold-lazy (H200, bf16 32/8, B·S 16k: causal 4k 576 /
//            16k 674 TFLOP/s against pingpong's 512 / 590, non-causal 649 / 643 against 559 / 566;
//            bench/results/2026-12-02-3edaea0-prefill-tuned.json); at 64 pingpong-fold-lazy-m192-s4
//            (192-row CTAs of three consumer warpgroups, 4 K / V stages; H200 bf16 32/8 B·S 16k:
//            causal 4k 399 TFLOP/s against pingpong's 333, non-causal 4k 512 against 367, cuDNN
//            411-436 / 459-480; bench/results/2026-12-02-a7544ee-prefill-d64.json; the padded /
//            block_n / stages fields here stay the plain tiling's, TunedTiling gives the tune's);
//            pingpong at 80 / 96 (no tuned kernel there); overlap at 256, FA3's choice (no scheduler barrier at hdim > 128:
//            the MMAs of a 64 x 80 x 256 step pair outlast the softmax, so the turn-taking only adds
//            waits). Every schedule runs at every size.
struct Tiling {
  int padded, block_n, stages;
  int schedule;
  int block_m = kBlockM;
};
// A tiling's consumer warpgroups, its CTA's threads (+ the producer warpgroup) and the registers a
// consumer thread takes (setmaxnreg): the 64 K of an SM over one CTA, the producer at 24.
constexpr int Consumers(const Tiling& t) { return t.block_m / 64; }
constexpr int Threads(const Tiling& t) { return 128 * (1 + Consumers(t)); }
inline constexpr int kProducerRegisters = 24;
constexpr int ConsumerRegisters(const Tiling& t) { return Consumers(t) == 2 ? 240 : 160; }
// The index of (base, tune) in kScheduleSpecs.
constexpr int ScheduleIndex(Schedule base, int tune) {
  for (int i = 0; i < kNumSchedules; ++i) {
    if (kScheduleSpecs[i].base == base && kScheduleSpecs[i].tune == tune) return i;
  }
  return -1;
}
constexpr Tiling TilingFor(int d) {
  constexpr int kPingPong = ScheduleIndex(Schedule::kPingPong, kTuneNone);
  return d == 64                ? Tiling{64, 128, 2, ScheduleIndex(Schedule::kPingPong, kTuneFold | kTuneLazy | kTuneM192 | kTuneDeepKV)}
         : d == 80 || d == 96  ? Tiling{128, 128, 2, kPingPong}
         : d == 128            ? Tiling{128, 128, 2, ScheduleIndex(Schedule::kPingPong, kTuneFold | kTuneLazy)}
         : d == 256            ? Tiling{256, 80, 2, ScheduleIndex(Schedule::kOverlap, kTuneNone)}
                               : Tiling{0, 0, 0, 0};  // not one of kHeadDims
}
static_assert(TilingFor(128).schedule >= 0 && TilingFor(256).schedule >= 0, "defaults name a schedule");

// The tiling of head size d under a tune: its key tile, ring depth and query rows where the tune's
// tiling bits apply (TuneCompiled), else TilingFor(d). The wide tiles are per head size: 176 keys at
// D 128 (kTuneWideN), 192 at D 64 (kTuneN192); kTuneDeepKV deepens D 64's ring to 4 stages (at 192
// keys: 16 KB of Q and 4 x 48 KB of K / V, 209 KB); kTuneM192 takes 192 query rows at D 64.
constexpr Tiling TunedTiling(int d, int tune) {
  const Tiling plain = TilingFor(d);
  if (!TuneCompiled(d, tune)) return plain;
  const int block_n = (tune & kTuneWideN) ? 176 : (tune & kTuneN192) ? 192 : plain.block_n;
  const int stages = (tune & kTuneDeepKV) ? 4 : plain.stages;
  const int block_m = (tune & kTuneM192) ? 192 : plain.block_m;
  return Tiling{plain.padded, block_n, stages, ScheduleIndex(Schedule::kPingPong, tune), block_m};
}
// The most keys per step of any tiling (the handler's row-range check).
inline constexpr int kMaxBlockN = 192;

// Shared memory of one CTA for head size d: q_buffers x Q (2 in the persistent kernels), stages x
// (K, V), 1 KB of alignment slack and the barriers (all tiles are 128-byte-swizzled [rows][64]
// column blocks of the padded width).
constexpr int64_t SmemBytes(int d, int tune = kTuneNone, int q_buffers = 1) {
  const Tiling t = TunedTiling(d, tune);
  return int64_t(2) * t.padded * (q_buffers * t.block_m + 2 * t.stages * t.block_n) + 1024 + 256;
}
// The most a CTA may have on sm_90 (227 KB).
inline constexpr int64_t kMaxSmemBytes = 232448;

// Every compiled tiling within the hardware's limits: a wgmma N and a TMA box row count (<= 256, a
// multiple of 16: whole k-steps of P V; query rows whole consumer warpgroups, two or three), the
// shared memory, kMaxBlockN, the registers of an SM (setmaxnreg's, multiples of 8) and S + P + O of
// one consumer thread (f32 S kBlockN / 2, packed P kBlockN / 4, f32 O padded / 2 registers) leaving
// 32 of its registers (addresses, row state, spans; the fullest, 196 of 240 at D 128 with 176 keys
// and 128 of 160 with three consumers at D 64, compile without spills).
constexpr bool TilingFits(int d, int tune) {
  const Tiling t = TunedTiling(d, tune);
  const int regs = ConsumerRegisters(t);
  return t.block_n % 16 == 0 && t.block_n <= 256 && t.block_n <= kMaxBlockN && t.block_m % 64 == 0 &&
         t.block_m <= 256 && (Consumers(t) == 2 || Consumers(t) == 3) && SmemBytes(d, tune) <= kMaxSmemBytes &&
         regs % 8 == 0 && 128 * (kProducerRegisters + Consumers(t) * regs) <= 65536 &&
         t.block_n / 2 + t.block_n / 4 + t.padded / 2 <= regs - 32;
}
constexpr bool AllTilingsFit() {
  for (int d : kHeadDims) {
    if (!TilingFits(d, kTuneNone)) return false;
    for (const ScheduleSpec& spec : kScheduleSpecs) {
      if (!TilingFits(d, spec.tune)) return false;
    }
  }
  return true;
}
static_assert(AllTilingsFit(), "a tiling past a wgmma / TMA / shared-memory / register limit");

// The persistent kernels (engine.cuh RunPersistent: one CTA an SM loops over the tiles, loading the
// next tile's Q into a second buffer while it finishes this one) need a tiling that holds two Q
// tiles. Of the default tilings: D 64 (m192-s4, 177 KB), 80, 96 and 128 (193 KB) do; D 256 (64 KB
// of Q beside 160 KB of K / V) and D 128's n176 do not; those run one tile a CTA.
constexpr bool PersistentFits(int d, int tune) {
  return TilingFits(d, tune) && SmemBytes(d, tune, 2) <= kMaxSmemBytes;
}

// The persistent order's sections (engine.cuh IndexTile): as many (b, kvh) heads as keep their K and
// V within kPersistentL2Bytes (FA3's 32 MB of the H100 / H200's 50 / 60 MB L2), at least 1, at most
// all. A function of static shapes.
inline constexpr int64_t kPersistentL2Bytes = int64_t(32) << 20;
constexpr int PersistentSectionHeads(int64_t heads, int64_t kv_rows, int d, int elem_bytes) {
  const int64_t per_head = 2 * kv_rows * d * elem_bytes;
  const int64_t fit = per_head > 0 ? kPersistentL2Bytes / per_head : heads;
  return int(fit < 1 ? 1 : fit > heads ? heads : fit);
}

}  // namespace joa::prefill
