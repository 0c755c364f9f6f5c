#!/usr/bin/env bash
# Session 28, call B (~8 min): the dense row kernel's K split over a cluster (plan.h DenseRowSplit)
# and the decode planner's measured wave table. 1) GPU tests: dense row (splits 1 / 2 / 4, every
# fusion) and the decode planner's capped / B=1 tests; 2) one-row GEMVs on the ~1B / ~8B shapes,
# ours (planned) beside forced splits 1 / 2 / 4 and XLA; 3) the decode shapes whose plan the table
# changed (B=2 2304, B=4 1280 / 2048), ours / ours[ladder] / cuDNN; 4) ~1B fp16 B=1 ctx 1k whole
# with ours[s1] (the kernel as before) and ~8B fp16 B=1 ctx 2k likewise; 5) ~1B fp16 B=4 ctx 1k.
# To $OUT: prepare.log, tests.log, linear.json, dec.json, e2e_1b.json, e2e_8b.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 150 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider \
  tests/gpu/test_linear_gpu.py tests/gpu/test_decode_attention_gpu.py \
  -k "dense_row or capped or batch_1 or planner_picks" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el linear
timeout 80 python3 -m jax_onnx_attn.bench linear --rows 1 --formats fp16 --impls ours xla-nk \
  --plans 1,0 2,0 4,0 --max-seconds 70 --out "$out/linear.json" 2>&1 | grep -v Warning | tail -24
el decode
timeout 70 python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 2 4 \
  --ctx 1280 2048 2304 --qlen 1 --impls ours ours[ladder] jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 60 --out "$out/dec.json" 2>&1 | grep -v Warning | tail -14
el e2e 1b
timeout 150 python3 -m jax_onnx_attn.bench e2e --phases decode --models 1b --weights fp16 --batch 1 4 \
  --ctx 1024 --impls ours jax-peer --ours-env s1:JOA_DENSE_ROW_SPLIT=1 --profile none --no-verify \
  --max-seconds 140 --models-dir /tmp/models --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | grep -E "decode  |Error"
el e2e 8b
timeout 150 python3 -m jax_onnx_attn.bench e2e --phases decode --models 8b --weights fp16 --batch 1 \
  --ctx 2048 --impls ours jax-peer --ours-env s1:JOA_DENSE_ROW_SPLIT=1 --profile none --no-verify \
  --max-seconds 140 --models-dir /tmp/models --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | grep -E "decode  |Error"
el done
} 2>&1 | tee "$out/run.log"
