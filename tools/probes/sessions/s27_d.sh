#!/usr/bin/env bash
# Session 27, call D (~5 min): the "long" plan policy (plan.h PlanPolicy::kLong: "wave", but B=1 at
# head dim 128 takes no cluster beyond the first rung and splits of >= 4 tiles + the combine kernel).
# 1) the GPU test of the long plans (B=1 d128, ragged, against the reference and the default plan);
# 2) B=1 d128 decode, ours (wave) / ours[long] / cuDNN, fp16 at the e2e capacities and bf16 at
# issue 15's 4k / 8k; 3) ~8B fp16 B=1 ctx 2k whole, ours beside ours[long] and the JAX peer.
# To $OUT: prepare.log, tests.log, dec.json, e2e_8b.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 60 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_attention_gpu.py -k "long_plan" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el decode
timeout 65 python3 -m jax_onnx_attn.bench decode --dtypes fp16 bf16 --heads 32/8 --dims 128 --batch 1 \
  --ctx 1280 2304 4096 8192 --qlen 1 --impls ours ours[long] jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 55 --out "$out/dec.json" 2>&1 | grep -v Warning | tail -12
el e2e
timeout 160 python3 -m jax_onnx_attn.bench e2e --phases decode --models 8b --weights fp16 --batch 1 \
  --ctx 2048 --impls ours jax-peer --ours-env long:JOA_DECODE_PLAN=long --profile none --no-verify \
  --max-seconds 150 --models-dir /tmp/models --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | grep -E "decode  |Error"
el done
} 2>&1 | tee "$out/run.log"
