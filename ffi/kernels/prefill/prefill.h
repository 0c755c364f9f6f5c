// The prefill engine as handlers see it: one launch per (dtype, head size).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/prefill/params.h"

namespace joa::prefill {

// Builds the tensor maps of q [B * Hq * S, D] and k / v [B * Hkv * T, D] (p's shapes) and launches
// the engine on `stream` (nothing when there are no query rows). T: __half or __nv_bfloat16; kD:
// one of kHeadDims; spec: the consumers' order of work and its tuning (params.h kScheduleSpecs).
// persistent: one CTA an SM looping over the tiles (engine.cuh RunPersistent) where the call runs
// the head size's default schedule unsplit and its tiling holds two Q tiles (params.h
// PersistentFits), else one tile a CTA; the same bits either way. Geometry from p's static shapes
// and the device's SM count only. p.m_blocks is filled here.
template <typename T, int kD>
cudaError_t Launch(PrefillParams p, const void* q, const void* k, const void* v, ScheduleSpec spec,
                   bool persistent, cudaStream_t stream);

// One per kHeadDims entry and element type (params.h; the handler dispatches on the same list).
#define JOA_PREFILL_INSTANCES(X)                                                                         \
  X(__half, 64) X(__half, 80) X(__half, 96) X(__half, 128) X(__half, 256) X(__nv_bfloat16, 64)          \
      X(__nv_bfloat16, 80) X(__nv_bfloat16, 96) X(__nv_bfloat16, 128) X(__nv_bfloat16, 256)
#define JOA_PREFILL_DECLARE(T, D) \
  extern template cudaError_t Launch<T, D>(PrefillParams, const void*, const void*, const void*, ScheduleSpec, \
                                          bool, cudaStream_t);
JOA_PREFILL_INSTANCES(JOA_PREFILL_DECLARE)
#undef JOA_PREFILL_DECLARE

}  // namespace joa::prefill
