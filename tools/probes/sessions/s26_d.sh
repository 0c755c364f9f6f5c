#!/usr/bin/env bash
# Session 26, call D (~6 min): the planner picks an int8 / int4 cache's kernel (plan.h QuantPath:
# the register kernel from kQuantRegsMinRows KV rows a call on, the tile kernel below). 1) GPU tests:
# both quantised paths forced, the decode paths, the session (its default routing); 2) the routing
# at the sweep's ends (ours / ours[tiles] / ours[regs], B 1 / 8, ctx 4k / 128k); 3) ~8B fp16 B=1 ctx
# 2k whole step (the decode kernel's whole-tile branch) beside the JAX peer. To $OUT: prepare.log,
# tests.log, route.json, e2e_8b.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 170 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_decode_quant_regs_gpu.py \
  tests/gpu/test_decode_quant_gpu.py tests/gpu/test_decode_paths_gpu.py tests/gpu/test_session_gpu.py \
  -k "not test_shapes" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el route
timeout 70 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 1 8 \
  --ctx 4096 131072 --qlen 1 --kv-bits 8 4 --impls ours ours[tiles] ours[regs] --target-ms 10 --reps 3 \
  --max-seconds 60 --out "$out/route.json" 2>&1 | grep -v "us/" | tail -12
el e2e
timeout 170 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 --batch 1 --ctx 2048 --phases decode \
  --impls ours jax-peer --profile none --max-seconds 160 --models-dir /tmp/models \
  --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | grep -E "decode  |verify"
el done
} 2>&1 | tee "$out/run.log"
