#!/usr/bin/env bash
# Session 29, call D (~5 min): the landed kernel (feb0275: warp copies for int4 caches only), call
# B's headline, channel and grid steps (s29_b.sh) and the register path's GPU tests with the vmap
# test (the int8 path being call B's, already tested). To $OUT: as s29_b.sh, less route.json.
S29_STEPS="headline channel grid tests" \
S29_TESTS="tests/gpu/test_decode_quant_regs_gpu.py tests/gpu/test_spmd_gpu.py" exec bash "$(dirname "$0")/s29_b.sh" "$@"
