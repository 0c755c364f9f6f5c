#!/usr/bin/env bash
# Session 26, call E (~3 min): EXPERIMENT, int4 caches on the register kernel at four CTAs an SM
# (<= 128 registers, Q's fragments re-read from shared memory; plan.h MakeLayout). 1) the register
# path's int4 GPU tests (not the shape sweep); 2) int4 / int8 (unchanged, the control) / bf16 at
# B=8 128k and 32k, B=1 128k. To $OUT: prepare.log, tests.log, dec.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 80 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_decode_quant_regs_gpu.py \
  -k "int4 and not test_shapes" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el decode
timeout 90 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 8 1 \
  --ctx 32768 131072 --qlen 1 --kv-bits 0 8 4 --impls ours --target-ms 10 --reps 3 \
  --max-seconds 80 --out "$out/dec.json" 2>&1 | grep -v "us/" | tail -10
el done
} 2>&1 | tee "$out/run.log"
