#!/usr/bin/env bash
# Session 23, second call (~9 min): the rows planner re-fitted. 1) GPU tests: the rows file, every
# output written; 2) the ~1B (ctx 1k) and ~8B (ctx 2k) int4 decoders at B 8 / 32 beside the JAX peer;
# 3) where the ~8B int4 B=8 step goes (ours, profiled: kernels by device time); 4) the decode
# attention's fit plan at ~8B B=8 in the whole step.
# To $OUT: prepare.log, tests.log, e2e_1b.json, e2e_8b.json, profile.json, e2e_8b_fit.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 120 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_linear_rows_gpu.py \
  tests/gpu/test_linear_gpu.py::test_every_output_element_is_written > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -2 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el e2e
timeout 90 python3 -m jax_onnx_attn.bench e2e --models 1b --weights int4 --batch 8 32 --ctx 1024 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 80 --models-dir /tmp/models \
  --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | grep "decode\|total"
timeout 170 python3 -m jax_onnx_attn.bench e2e --models 8b --weights int4 --batch 8 32 --ctx 2048 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 160 --models-dir /tmp/models \
  --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | grep "decode\|total"
el profile
timeout 100 python3 -m jax_onnx_attn.bench e2e --models 8b --weights int4 --batch 8 --ctx 2048 \
  --phases decode --impls ours --profile all --no-verify --max-seconds 90 --models-dir /tmp/models \
  --out "$out/profile.json" 2>&1 | grep -v Warning | tail -2
el fit
# The decode attention's "fit" plan policy (session 15: B=8 2k d128 36.4 -> 25.9 µs in isolation) in
# the whole step, ours only (the JAX peer ran above, same process rule: compare with e2e_*.json).
JOA_DECODE_PLAN=fit timeout 60 python3 -m jax_onnx_attn.bench e2e --models 8b --weights int4 --batch 8 --ctx 2048 \
  --phases decode --impls ours --profile none --max-seconds 50 --models-dir /tmp/models \
  --out "$out/e2e_8b_fit.json" 2>&1 | grep -v Warning | grep "decode"
el done
} 2>&1 | tee "$out/run.log"
