#!/usr/bin/env bash
# Session 32, call F (~5 min): the decode GPU tests at the landed commit (call E's 170 s were too
# short for them): the float engine (values vs the reference, bitwise repeatability, command-buffer
# capture, variants) and the quantised register path. To $OUT: prepare.log, tests.log, run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 330 python3 -m pytest -m gpu -q -ra -n 12 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_attention_gpu.py tests/gpu/test_decode_quant_regs_gpu.py > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el done
} 2>&1 | tee "$out/run.log"
