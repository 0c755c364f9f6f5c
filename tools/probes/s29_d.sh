#!/usr/bin/env bash
# Session 29, call D (~6 min): the landed kernel (feb0275: warp copies for int4 caches only), call
# B's headline, channel and grid steps (s29_b.sh) and the GPU tests. (Call D itself ran the tests of
# test_decode_quant_regs_gpu.py and the vmap test only, the int8 path being call B's, already
# tested; this runs s29_b.sh's full list.) To $OUT: as s29_b.sh, less route.json.
S29_STEPS="headline channel grid tests" exec bash "$(dirname "$0")/s29_b.sh" "$@"
