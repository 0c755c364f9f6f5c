// Shared by the GEMV probes: the kernel parameters of y[1, n_out] = x[1, k] W^T for one weight of
// n rows (4-bit block-32 metadata when scales / zeros are given).
#pragma once

#include "kernels/gemv/params.h"

inline joa::gemv::GemvParams OneRowParams(const void* x, const void* w, const void* scales, const uint8_t* zeros,
                                          const void* gamma, void* y, int k, int n, bool gated) {
  joa::gemv::GemvParams p{};
  p.x = x;
  p.w = w;
  p.scales = scales;
  p.zeros = zeros;
  p.gamma = gamma;
  p.y = y;
  p.eps = 1e-6f;
  p.m = 1;
  p.k = k;
  p.n_rows = n;
  p.n_out = gated ? n / 2 : n;
  p.k_blocks = k / 32;
  p.block_shift = 5;
  return p;
}
