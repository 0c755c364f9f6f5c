// Launch of the prefill engine: the TMA tensor maps (encoded on the host through the driver entry
// point, no libcuda link), the shared-memory limit, the grid; instantiated for f16 / bf16 x head
// size 64 / 80 / 96 / 128 / 256 (kHeadDims) x the three consumer schedules x the mask variant
// (causal or not, windows, scale) or the softcap one, each with or without sinks; and the tuned
// pingpong kernels (params.h kScheduleSpecs) with the mask variant at D 64 and 128 (TuneCompiled).
// Split-KV (p.splits > 1, plan.h): the kSplit kernels of each head size's default schedule
// (PickDefaultKernel), then combine.cuh's kernel. Persistent (the launch option): the kPersistent
// kernels of the same default schedules where the tiling holds two Q tiles, one CTA an SM.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <type_traits>

#include "common/device.h"
#include "kernels/prefill/combine.cuh"
#include "kernels/prefill/engine.cuh"
#include "kernels/prefill/prefill.h"

namespace joa::prefill {
namespace {

// cuTensorMapEncodeTiled from the driver, looked up once (a host function pointer, no device state).
PFN_cuTensorMapEncodeTiled_v12000 EncodeTiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// A map over `rows` rows of d 16-bit elements, boxes of [box_rows][64] (128 bytes: one swizzle
// span), 128-byte swizzle, zeros out of bounds (so a box at column 64 of a row of 80 or 96 fills
// the padded tile's columns past d with zeros).
template <typename T>
cudaError_t MakeMap(CUtensorMap* map, const void* ptr, uint64_t rows, int d, int box_rows) {
  const auto encode = EncodeTiled();
  if (encode == nullptr) return cudaErrorNotSupported;
  const CUtensorMapDataType type =
      std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint64_t dims[2] = {cuuint64_t(d), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(d) * sizeof(T)};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, type, 2, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The kernel of Variant for the schedule.
template <typename T, int kD, class Variant>
auto PickKernel(Schedule schedule) {
  return schedule == Schedule::kPingPong ? PrefillKernel<T, kD, Variant, Schedule::kPingPong>
         : schedule == Schedule::kOverlap ? PrefillKernel<T, kD, Variant, Schedule::kOverlap>
                                          : PrefillKernel<T, kD, Variant, Schedule::kSerial>;
}

// The tuned pingpong kernel of a kScheduleSpecs tune (MaskVariant, at the head sizes TuneCompiled
// names), or null for tune 0 and anything not compiled. One kernel per spec of kScheduleSpecs from
// spec kI on, so that a new name there is all a new tuned kernel needs.
template <typename T, int kD, int kI = 0>
auto PickTunedKernel(int tune) {
  using K = decltype(&PrefillKernel<T, kD, MaskVariant, Schedule::kPingPong>);
  if constexpr (kI == kNumSchedules) {
    return K(nullptr);
  } else {
    constexpr ScheduleSpec kSpec = kScheduleSpecs[kI];
    if constexpr (kSpec.base == Schedule::kPingPong && TuneCompiled(kD, kSpec.tune)) {
      if (tune == kSpec.tune) return K(PrefillKernel<T, kD, MaskVariant, Schedule::kPingPong, kSpec.tune>);
    }
    return PickTunedKernel<T, kD, kI + 1>(tune);
  }
}

// The kernel of a variant at the head size's default schedule (TilingFor(kD).schedule, what calls
// that name no schedule run), with its tune where the plain launch would run it (the mask variant,
// and scale > 0 under kTuneFold), else its base schedule: the split-KV kernels (engine.cuh kSplit;
// the handler refuses splits > 1 with another schedule) and the persistent ones (kPersistent; where
// the tiling holds two Q tiles, PersistentTune). *tune: the tune of the kernel returned.
template <typename T, int kD, bool kSplit, bool kPersistent>
auto PickDefaultKernel(bool sink, bool cap, float scale, int* tune) {
  constexpr ScheduleSpec kDefault = kScheduleSpecs[TilingFor(kD).schedule];
  constexpr Schedule kBase = kDefault.base;
  const bool tuned = !sink && !cap && (!(kDefault.tune & kTuneFold) || scale > 0.f);
  *tune = tuned ? kDefault.tune : kTuneNone;
  return cap ? (sink ? PrefillKernel<T, kD, WithSink<CapVariant>, kBase, kTuneNone, kSplit, kPersistent>
                     : PrefillKernel<T, kD, CapVariant, kBase, kTuneNone, kSplit, kPersistent>)
         : sink ? PrefillKernel<T, kD, WithSink<MaskVariant>, kBase, kTuneNone, kSplit, kPersistent>
         : tuned ? PrefillKernel<T, kD, MaskVariant, kBase, kDefault.tune, kSplit, kPersistent>
                 : PrefillKernel<T, kD, MaskVariant, kBase, kTuneNone, kSplit, kPersistent>;
}

// Whether head size kD has persistent kernels: its default schedule's tilings (tuned and plain) hold
// two Q tiles (params.h PersistentFits).
template <int kD>
inline constexpr bool kPersistentCompiled =
    PersistentFits(kD, kScheduleSpecs[TilingFor(kD).schedule].tune) && PersistentFits(kD, kTuneNone);

}  // namespace

template <typename T, int kD>
cudaError_t Launch(PrefillParams p, const void* q, const void* k, const void* v, ScheduleSpec spec,
                   bool persistent, cudaStream_t stream) {
  if (p.batch == 0 || p.kv_heads == 0 || p.rows == 0) return cudaSuccess;
  const Schedule schedule = spec.base;
  // Sinks (the epilogue adds them) and softcap (a tanhf per logit) have their own instantiations;
  // without either, the plain MaskVariant kernels. A tune runs only where it is instantiated
  // (TuneCompiled, MaskVariant) and, folding the scale, with scale > 0; anywhere else the base
  // schedule's kernel. Persistent: the default schedule's kernels, unsplit, where compiled; any other
  // call runs one tile a CTA (the same bits).
  const bool sink = p.variant.sink != nullptr, cap = p.variant.softcap > 0.f;
  const bool split = p.splits > 1;
  const bool is_default = ScheduleIndex(spec.base, spec.tune) == TilingFor(kD).schedule;
  if (split && !is_default) return cudaErrorInvalidValue;
  int default_tune = kTuneNone;
  using K = decltype(&PrefillKernel<T, kD, MaskVariant, Schedule::kPingPong>);
  K default_kernel = nullptr;
  const int sms = persistent && !split && is_default && kPersistentCompiled<kD> ? CurrentSmCount() : 0;
  if (split) {
    default_kernel = PickDefaultKernel<T, kD, true, false>(sink, cap, p.variant.scale, &default_tune);
  } else if (sms > 0) {
    if constexpr (kPersistentCompiled<kD>) {
      default_kernel = PickDefaultKernel<T, kD, false, true>(sink, cap, p.variant.scale, &default_tune);
    }
  }
  auto* tuned = default_kernel != nullptr || sink || cap || !(p.variant.scale > 0.f)
                    ? nullptr : PickTunedKernel<T, kD>(spec.tune);
  const int tune = default_kernel != nullptr ? default_tune : tuned != nullptr ? spec.tune : kTuneNone;
  const Tiling kTiling = TunedTiling(kD, tune);
  p.m_blocks = (p.rows + kTiling.block_m - 1) / kTiling.block_m;
  CUtensorMap q_map, k_map, v_map;
  cudaError_t err = MakeMap<T>(&q_map, q, uint64_t(p.batch) * p.q_heads * p.q_rows, kD, kTiling.block_m);
  if (err == cudaSuccess && p.kv_rows > 0) {
    const uint64_t kv_rows = uint64_t(p.batch) * p.kv_heads * p.kv_rows;
    err = MakeMap<T>(&k_map, k, kv_rows, kD, kTiling.block_n);
    if (err == cudaSuccess) err = MakeMap<T>(&v_map, v, kv_rows, kD, kTiling.block_n);
  } else {
    k_map = v_map = q_map;  // no keys: never read
  }
  if (err != cudaSuccess) return err;
  auto* kernel = default_kernel != nullptr ? default_kernel
                 : tuned != nullptr ? tuned
                 : cap           ? (sink ? PickKernel<T, kD, WithSink<CapVariant>>(schedule)
                                         : PickKernel<T, kD, CapVariant>(schedule))
                                 : (sink ? PickKernel<T, kD, WithSink<MaskVariant>>(schedule)
                                         : PickKernel<T, kD, MaskVariant>(schedule));
  const bool persistent_kernel = sms > 0 && default_kernel != nullptr;
  const int64_t smem = SmemBytes(kD, tune, persistent_kernel ? 2 : 1);
  // A function attribute, not stream work: allowed while XLA captures the stream.
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  // One CTA a tile (< 2^31: the handler checks), or persistent: one CTA an SM (the kernels' 1 CTA an
  // SM: registers and shared memory), each looping over its share of the tiles.
  const int64_t tiles = int64_t(p.batch) * p.kv_heads * p.m_blocks * p.splits;
  const dim3 grid(unsigned(persistent_kernel ? std::min<int64_t>(tiles, sms) : tiles));
  kernel<<<grid, Threads(kTiling), smem, stream>>>(q_map, k_map, v_map, p);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.splits == 1) return err;

  // The combine, in the same stream, as a programmatic dependent launch (the decode combine's way).
  return LaunchCombine(PrefillCombineKernel<T, kD>, p, int64_t(p.batch) * p.kv_heads * p.rows, kCombineWarps,
                       /*pdl=*/true, stream);
}

#define JOA_PREFILL_INSTANTIATE(T, D) \
  template cudaError_t Launch<T, D>(PrefillParams, const void*, const void*, const void*, ScheduleSpec, bool, \
                                    cudaStream_t);
JOA_PREFILL_INSTANCES(JOA_PREFILL_INSTANTIATE)
#undef JOA_PREFILL_INSTANTIATE

}  // namespace joa::prefill
