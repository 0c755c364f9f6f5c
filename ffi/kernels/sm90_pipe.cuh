// The sm_90 pipeline primitives the Hopper engines share (the prefill engine, the GEMV slots, the
// decode engine's producer warp, the GEMV rows kernel's reduction): mbarriers with transaction
// counts, the multicast bulk copy global -> shared and the shared -> another CTA's shared copy
// (cp.async.bulk), the cluster barrier halves, named barriers and the async-proxy
// fence. Raw PTX of sm_90 (not sm_90a-only): callers compile their
// calls only for __CUDA_ARCH__ >= 900 (or sm_90a) and refuse or skip other GPUs.
#pragma once

#include <cstdint>

namespace joa::sm90 {

// --- mbarrier (shared::cta) ----------------------------------------------------------------------

__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (TMA) and to the other threads (with
// the __syncthreads that follows).
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` of transactions (the TMA copies completing on it).
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Waits until the phase of parity `parity` has completed. A fresh barrier is in phase 0, so a wait
// on parity 1 returns at once (how a producer passes its first round of "empty" barriers).
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// --- bulk copies (cp.async.bulk, no tensor map) -------------------------------------------------

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory to the same
// shared-memory offset `dst` in every CTA of the cluster named in `cta_mask`, completing `bytes` on
// the barrier at offset `bar` of each of them (one request to L2 for all of them).
__device__ __forceinline__ void BulkLoadMulticast(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                                  uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar), "h"(cta_mask)
      : "memory");
}

// The shared::cluster address of the shared-memory address `addr` (this CTA's) in CTA `rank`.
__device__ __forceinline__ uint32_t MapShared(uint32_t addr, int rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from this CTA's shared memory
// `src` to `dst` in another CTA of the cluster (MapShared addresses), completing `bytes` on that
// CTA's barrier `bar` (a MapShared address). The source must stay until the copy has read it: the
// receiver's barrier is the only completion.
__device__ __forceinline__ void BulkCopyToCluster(uint32_t dst, uint32_t src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "r"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// The cluster barrier in two halves: every thread of every CTA arrives (release), then waits
// (acquire) until all have.
__device__ __forceinline__ void ClusterArrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
// The same arrival without release semantics (no MEMBAR.GPU: it does not wait for the thread's
// loads and stores in flight), for handshakes ordered otherwise (fence.mbarrier_init, an mbarrier).
__device__ __forceinline__ void ClusterArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// --- ordering ------------------------------------------------------------------------------------

// Orders this thread's ordinary shared-memory writes before later async-proxy reads (wgmma, TMA).
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// A barrier among `threads` threads (a multiple of 32) under id `id` (1-15; 0 is __syncthreads).
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrives on barrier `id` without waiting (the threads that sync on it wait for `threads` in all).
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace joa::sm90
