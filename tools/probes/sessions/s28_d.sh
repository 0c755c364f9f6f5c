#!/usr/bin/env bash
# Session 28, call D (~5 min): 1) the decode engine's GPU tests but the shape sweep, with the vmap
# test (the measured wave table's plans at B=2-16 among them; call C ran out of time before them);
# 2) B=1 d128 split sizes at 8k / 16k (the 4-tile floor of the B=1 rule against longer splits).
# To $OUT: prepare.log, tests.log, run.log (the sweeps in run.log).
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el sweep
for shape in "fp16 8192 256 512 1024" "bf16 8192 256 512 1024" "bf16 16384 512 1024 2048"; do
  set -- $shape
  timeout 40 python3 tools/sweep_splits.py --batch 1 --ctx $2 --dim 128 --dtype $1 --split-rows $3 $4 $5 \
    --out "/tmp/sweep_$1_$2.json" 2>&1 | grep -v Warning | grep " us "
done
el tests
timeout 240 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_attention_gpu.py tests/gpu/test_spmd_gpu.py -k "not test_shapes and (vmap or not spmd)" \
  > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el done
} 2>&1 | tee "$out/run.log"
