// Thin wrappers over the sm_80+ instructions the attention engines use: cp.async (16 / 8-byte global ->
// shared copies with zero fill), ldmatrix, mma.sync m16n8k16 with f32 accumulation, a NaN-propagating
// max, exp2, and programmatic dependent launch (sm_90; no-ops before).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace joa::ptx {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes, or writes 16 zero bytes when !valid (src is then not read). .cg keeps streamed
// KV out of L1. The L2 prefetch size: 128 B measured best on the H200 (B=8 x 128k decode: 4120 GB/s
// vs 4034 with 256 B, 4045 with none, 4000 with 256 B + evict_first; bench/results/
// 2026-11-30-decode-notes.md, session 3).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

// 8 bytes (zero fill when !valid), through L1: .cg takes 16-byte copies only. For rows that are not
// whole 16-byte chunks (an int4 cache row of 80 values is 40 bytes).
__device__ __forceinline__ void CpAsync8(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 8 : 0));
}

// A 32-bit global load issued where it stands: volatile, so the compiler neither sinks it to its
// first use nor past the copies issued after it (its round trip overlaps theirs).
__device__ __forceinline__ int LoadGlobalS32(const int* p) {
  int v;
  asm volatile("ld.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }

// Arrives on the mbarrier at shared address `bar` once every cp.async this thread has issued so far
// has landed, without raising its expected count first (.noinc: the barrier's count includes this
// arrival). The producer warp's way of completing a ring stage (decode engine.cuh).
__device__ __forceinline__ void CpAsyncMbarArrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Two 8x8 b16 matrices: lanes 0-7 give the rows of the first, 8-15 of the second.
__device__ __forceinline__ void LdMatrixX2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// The transpose of an 8x8 b16 matrix held as an MMA fragment (lane 4 g + t: row g, columns 2t and
// 2t + 1): the lane gets row g of the transpose, i.e. column g's elements of rows 2t and 2t + 1.
__device__ __forceinline__ uint32_t MovMatrixTrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d[4] += a[4] (16x16, row) * b[2] (16x8, col), f32 accumulators.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);

template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void Mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same MMA as an ordinary asm: a pure function of its registers (no side effects), so the
// compiler may interleave independent accumulator chains and move loads above it. The volatile
// form above keeps program order, which serialises a warp's load -> MMA -> load -> MMA chain.
template <typename T>
__device__ __forceinline__ void Mma16816Free(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// f(a, b, c) in one instruction, kLut the truth table of f (a: 0xF0, b: 0xCC, c: 0xAA): AndOr is
// (a & b) | c, AndXor (a & b) ^ c. Written in C with two constants these compile to two LOP3s (one
// immediate operand each); as one lop3, ptxas keeps a constant in a register and emits one.
template <unsigned kLut>
__device__ __forceinline__ uint32_t Lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(kLut));
  return d;
}
__device__ __forceinline__ uint32_t AndOr(uint32_t a, uint32_t b, uint32_t c) { return Lop3<0xEA>(a, b, c); }
__device__ __forceinline__ uint32_t AndXor(uint32_t a, uint32_t b, uint32_t c) { return Lop3<0x6A>(a, b, c); }

// Two floats -> one register of two 16-bit values, lo in the low half (the lower column).
template <typename T>
__device__ __forceinline__ uint32_t Pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t Pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t Pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// max(a, b) that is NaN when either is (fmaxf drops a NaN): one max.NaN.f32, no branch. A NaN
// log-sum-exp must poison the row it belongs to, never vanish from it (docs/attention.md, "NaN and
// Inf"). Not volatile: the compiler may schedule or merge it like fmaxf.
__device__ __forceinline__ float MaxNan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Programmatic dependent launch: the dependent grid may start once every CTA of this grid has
// called LaunchDependents; WaitForPrimary blocks until the primary grid has completed and its
// writes are visible. Both are no-ops below sm_90 or without the launch attribute.
__device__ __forceinline__ void LaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

__device__ __forceinline__ void WaitForPrimary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace joa::ptx
