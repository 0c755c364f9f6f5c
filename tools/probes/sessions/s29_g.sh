#!/usr/bin/env bash
# Session 29, call G (~3 min): after the review (ptx.cuh's AndOr shared with the GEMV engine, one
# cp.async-by-size helper; same SASS where compared): the GPU tests of the register-dequantised
# decode path, the vmap test and the GEMV engine's int4 record / rows kernels.
# To $OUT: prepare.log, tests.log, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
{
timeout 200 python3 -m pytest -m gpu -q -ra -n 16 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_quant_regs_gpu.py tests/gpu/test_spmd_gpu.py tests/gpu/test_linear_record_gpu.py \
  tests/gpu/test_linear_rows_gpu.py -k "vmap or not spmd" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
} 2>&1 | tee "$out/run.log"
