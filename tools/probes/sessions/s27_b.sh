#!/usr/bin/env bash
# Session 27, call B (~8 min): 1) the decode planner's "wave" policy (plan.h PlanPolicy::kWave: the
# ladder's clusters capped by one wave of clusters) against the ladder (ours), "fit" and cuDNN at
# B = 2 / 4 / 8, capacity 1k-4k, fp16 32/8 d64 / d128; 2) the FFI record stage at ~8B fp16 B=1 ctx 2k
# (call A's repeats were skipped by the bench's time budget): off / on / off / on, separate
# processes. To $OUT: prepare.log, dec.json, fp16_{off,on}{1,2}.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
run() {  # name, record (0 / 1)
  local name=$1 rec=$2 impls="ours jax-peer"
  [ "$rec" = 1 ] && impls="ours"
  JOA_FFI_RECORD=$rec timeout 170 python3 -m jax_onnx_attn.bench e2e --phases decode --models 8b \
    --weights fp16 --batch 1 --ctx 2048 --impls $impls --profile none --no-verify \
    --max-seconds 160 --models-dir /tmp/models --out "$out/$name.json" 2>&1 |
    grep -v Warning | grep -E "decode  |Error|error" | head -4
}
{
el decode
timeout 150 python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 2 4 8 \
  --ctx 1024 2048 4096 --qlen 1 --impls ours ours[wave] ours[fit] jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 140 --out "$out/dec.json" 2>&1 | grep -v Warning | tail -22
el fp16_off1; run fp16_off1 0
el fp16_on1; run fp16_on1 1
el fp16_off2; run fp16_off2 0
el fp16_on2; run fp16_on2 1
el done
} 2>&1 | tee "$out/run.log"
