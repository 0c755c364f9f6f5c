#!/usr/bin/env bash
# Session 30, call G (~4 min): plan.h kQuantRegsMinRows 131072 -> 65536 KV rows. 1) the GPU tests
# that depend on the route (the vmap fold, the default kernel's bits) and the quantised paths;
# 2) "ours" (the planned kernel) beside both forced at 32k-128k rows.
# To $OUT: prepare.log, tests.log, route.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
{
timeout 230 python3 -m pytest -m gpu -q -ra -n 16 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_quant_regs_gpu.py tests/gpu/test_decode_quant_gpu.py tests/gpu/test_spmd_gpu.py \
  -k "vmap or not spmd" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
timeout 90 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 1 2 4 \
  --ctx 4096 8192 --qlen 1 --kv-bits 8 4 --impls ours ours[tiles] ours[key-rows] --target-ms 10 --reps 3 \
  --max-seconds 80 --out "$out/route.json" 2>&1 | grep -v Warning | tail -16
} 2>&1 | tee "$out/run.log"
