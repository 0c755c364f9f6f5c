// The GEMV engine's weight policies (ffi/kernels/gemv/weights.cuh: DenseWeights, NbitsWeights'
// MakeLane / Issue / Read) compiled for the host and run for every lane of every chunk and row
// tile: cp.async is a 16-byte copy (zero fill when !valid) into an emulated ring slot. Checks each
// lane's W bytes, scales and zero points against the row-major weights, that no copy writes past
// the slot, and that every copy names an aligned address inside W / scales / zero points (even a
// zero-filled one). tests/test_linear.py builds it: the policies' source from weights.cuh's
// "// Dense T weights" on is included as weights_policies.h after the host stand-ins below for the
// CUDA types and the PTX helpers above it. Exit status 0: all good.
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <type_traits>

// Host stand-ins: CUDA qualifiers and types; the half-precision intrinsics are declared only
// (Fragments() is not instantiated here).
#define __device__
#define __forceinline__ inline
#define __grid_constant__
using std::max; using std::min;
struct uint4 { uint32_t x, y, z, w; };
struct __half { uint16_t v; };
struct __nv_bfloat16 { uint16_t v; };
struct __half2 { uint32_t v; };
struct __nv_bfloat162 { uint32_t v; };
__half2 __hsub2(__half2, __half2); __half2 __hmul2(__half2, __half2); __half2 __hfma2(__half2, __half2, __half2);
__nv_bfloat162 __hsub2(__nv_bfloat162, __nv_bfloat162); __nv_bfloat162 __hmul2(__nv_bfloat162, __nv_bfloat162);
__nv_bfloat162 __floats2bfloat162_rn(float, float);
float __uint_as_float(uint32_t); float __fmul_rn(float, float); float __fsub_rn(float, float);
#include "kernels/gemv/params.h"
#include "kernels/gemv/plan.h"
namespace joa::gemv {
// The PTX helpers weights.cuh defines above DenseWeights. The emulated shared memory (SmemAddr
// offsets into g_smem) and the global buffers a copy may name; g_bad counts copies whose source is
// not an aligned address inside one of them.
inline unsigned char* g_smem = nullptr;
struct Region { const unsigned char* p; size_t n; };
inline Region g_regions[3];
inline long g_bad = 0;
inline void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const unsigned char* s = static_cast<const unsigned char*>(src);
  bool in = false;
  for (auto& r : g_regions) if (r.p && s >= r.p && s + 16 <= r.p + r.n) in = true;
  if (!in || (reinterpret_cast<uintptr_t>(s) & 15) || (dst & 15)) ++g_bad;
  if (valid) std::memcpy(g_smem + dst, s, 16); else std::memset(g_smem + dst, 0, 16);
}
inline uint32_t SmemAddr(const void* p) { return uint32_t(static_cast<const unsigned char*>(p) - g_smem); }
inline uint32_t AndOr(uint32_t a, uint32_t b, uint32_t c) { return (a & b) | c; }
inline uint32_t Prmt(uint32_t, uint32_t, uint32_t) { return 0; }
template <typename T> struct Half2;
template <> struct Half2<__half> { using type = __half2; };
template <> struct Half2<__nv_bfloat16> { using type = __nv_bfloat162; };
template <typename T> typename Half2<T>::type AsH2(uint32_t v) { return {v}; }
template <typename H2> uint32_t AsU32(H2 v) { return v.v; }
template <typename T> uint32_t SubMul(uint32_t a, uint32_t b, uint32_t s);
}  // namespace joa::gemv

#include "weights_policies.h"  // weights.cuh from DenseWeights on

#include <random>
#include <vector>
using namespace joa::gemv;

static long g_fail = 0;
#define CHECK(c, ...) do { if (!(c)) { if (g_fail++ < 10) { std::printf(__VA_ARGS__); std::printf("\n"); } } } while (0)

template <int kBits, bool kWide, typename T = __half>
void RunNbits(int n, int k, int block, bool zp, std::mt19937& rng) {
  using Wt = NbitsWeights<T, kBits, kWide>;
  constexpr FormatInfo f = Wt::kInfo;
  const int kb = k / block, tiles = (n + 15) / 16, row_bytes = k * kBits / 8;
  std::vector<unsigned char> w(size_t(n) * row_bytes);
  for (auto& b : w) b = rng();
  std::vector<uint16_t> s_rm(size_t(n) * kb), st(size_t(tiles) * kb * 16, 0);
  std::vector<unsigned char> z_rm(size_t(n) * kb), zt(size_t(tiles) * kb * 16, 0);
  for (int r = 0; r < n; ++r)
    for (int b = 0; b < kb; ++b) {
      s_rm[r * kb + b] = uint16_t(1 + rng() % 60000);  // never 0
      z_rm[r * kb + b] = uint8_t(rng() % (1 << kBits));
      st[(size_t(r / 16) * kb + b) * 16 + r % 16] = s_rm[r * kb + b];
      zt[(size_t(r / 16) * kb + b) * 16 + r % 16] = z_rm[r * kb + b];
    }
  GemvParams p{};
  p.n_rows = n; p.k = k; p.k_blocks = kb;
  p.block_shift = 0;
  while ((1 << p.block_shift) < block) ++p.block_shift;
  p.w = w.data(); p.scales = st.data(); p.zeros = zp ? zt.data() : nullptr;
  g_regions[0] = {w.data(), w.size()};
  g_regions[1] = {reinterpret_cast<unsigned char*>(st.data()), st.size() * 2};
  g_regions[2] = {zp ? zt.data() : nullptr, zt.size()};
  std::vector<unsigned char> stage(Wt::kStageBytes + 64);
  g_smem = stage.data();
  const int kc = (k + f.chunk_k - 1) / f.chunk_k;
  for (int tile = 0; tile < tiles + 1; ++tile) {  // one tile wholly past N
    for (int c = 0; c < kc; ++c) {
      std::memset(stage.data(), 0xAB, stage.size());
      for (int lane = 0; lane < 32; ++lane) {
        const auto ln = Wt::MakeLane(p, lane);
        Wt::Issue(stage.data(), p, ln, 16 * tile + lane / 4, c);
      }
      for (int i = Wt::kStageBytes; i < int(stage.size()); ++i) CHECK(stage[i] == 0xAB, "write past the slot");
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        const auto ln = Wt::MakeLane(p, lane);
        for (int pc = 0; pc < Wt::kReads; ++pc) {
          const auto ch = Wt::Read(stage.data(), p, ln, pc);
          const int kk = c * f.chunk_k + f.lane_stride * t + f.piece_stride * pc;
          for (int h = 0; h < 2; ++h) {
            const int r = 16 * tile + g + 8 * h;
            const bool valid = r < n && kk < k;
            unsigned char want[16] = {};
            if (valid) std::memcpy(want, &w[size_t(r) * row_bytes + size_t(kk) * kBits / 8], 16);
            CHECK(std::memcmp(want, &ch.w[h], 16) == 0, "W bits=%d wide=%d block=%d tile=%d c=%d lane=%d pc=%d h=%d",
                  kBits, kWide, block, tile, c, lane, pc, h);
            const uint32_t ws = valid ? s_rm[r * kb + kk / block] : 0;
            CHECK(ch.scale[h] == ws, "scale bits=%d wide=%d block=%d zp=%d tile=%d c=%d lane=%d pc=%d h=%d got %u want %u",
                  kBits, kWide, block, zp, tile, c, lane, pc, h, ch.scale[h], ws);
            const uint32_t wz = !zp ? (1u << (kBits - 1)) : valid ? z_rm[r * kb + kk / block] : 0;
            if (valid || !zp) CHECK(ch.zero[h] == wz, "zero bits=%d wide=%d block=%d tile=%d c=%d lane=%d pc=%d h=%d got %u want %u",
                                    kBits, kWide, block, tile, c, lane, pc, h, ch.zero[h], wz);
          }
        }
      }
    }
  }
}

template <typename T>
void RunDense(int n, int k, std::mt19937& rng) {
  using Wt = DenseWeights<T>;
  constexpr FormatInfo f = Wt::kInfo;
  std::vector<uint16_t> w(size_t(n) * k);
  for (auto& v : w) v = uint16_t(rng());
  GemvParams p{};
  p.n_rows = n; p.k = k; p.w = w.data();
  g_regions[0] = {reinterpret_cast<unsigned char*>(w.data()), w.size() * 2};
  g_regions[1] = g_regions[2] = {nullptr, 0};
  std::vector<unsigned char> stage(Wt::kStageBytes + 64);
  g_smem = stage.data();
  const int kc = (k + f.chunk_k - 1) / f.chunk_k;
  for (int tile = 0; tile < (n + 15) / 16 + 1; ++tile)
    for (int c = 0; c < kc; ++c) {
      std::memset(stage.data(), 0xAB, stage.size());
      for (int lane = 0; lane < 32; ++lane) Wt::Issue(stage.data(), p, Wt::MakeLane(p, lane), 16 * tile + lane / 4, c);
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        const auto ch = Wt::Read(stage.data(), p, Wt::MakeLane(p, lane), 0);
        for (int q = 0; q < f.quads; ++q)
          for (int h = 0; h < 2; ++h) {
            const int r = 16 * tile + g + 8 * h, kk = c * f.chunk_k + f.lane_stride * t + 32 * q;  // 237b642's map
            uint16_t want[8] = {};
            if (r < n && kk < k) std::memcpy(want, &w[size_t(r) * k + kk], 16);
            CHECK(std::memcmp(want, &ch.w[h][q], 16) == 0, "dense tile=%d c=%d lane=%d q=%d h=%d", tile, c, lane, q, h);
          }
      }
    }
}

int main() {
  std::mt19937 rng(1);
  for (int block : {16, 32, 64, 128, 256, 512}) {
    for (bool zp : {false, true}) {
      for (int kblocks : {1, 3, 8, 9}) {
        for (int n : {8, 24, 40}) {
          const int k = block * kblocks;
          RunNbits<8, false>(n, k, block, zp, rng);
          RunNbits<8, true>(n, k, block, zp, rng);
          if (block >= 32) {
            RunNbits<4, false>(n, k, block, zp, rng);
            RunNbits<4, true>(n, k, block, zp, rng);
            RunNbits<4, false, __nv_bfloat16>(n, k, block, zp, rng);
            RunNbits<4, true, __nv_bfloat16>(n, k, block, zp, rng);
          }
        }
      }
    }
  }
  for (int k : {8, 64, 72, 200, 1000}) for (int n : {8, 24, 40}) { RunDense<__half>(n, k, rng); RunDense<__nv_bfloat16>(n, k, rng); }
  std::printf("failures %ld, bad copy sources %ld\n", g_fail, g_bad);
  return g_fail || g_bad;
}
