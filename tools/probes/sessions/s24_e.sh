#!/usr/bin/env bash
# Session 24, fifth call (~6 min): the GPU tests of the swizzled decode tiles in full (call three's
# 200 s cut them at 94%, every one run passing): every layout and option at f16 (and every test that
# is not a shape sweep at bf16), the quantised tile path, the NaN / Inf semantics of the decode engine.
# To $OUT: prepare.log, tests.log, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 330 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_decode_attention_gpu.py \
  tests/gpu/test_decode_tile128_gpu.py tests/gpu/test_decode_producer_gpu.py tests/gpu/test_decode_quant_gpu.py \
  tests/gpu/test_nan_inf_gpu.py -k "not test_shapes or float16" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -3 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el done
} 2>&1 | tee "$out/run.log"
