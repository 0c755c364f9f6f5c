#!/usr/bin/env bash
# Session 30, call D (~6 min): whole decode steps with the float cache's key-rows form
# (JOA_DECODE_KEY_ROWS=1, "ours[kr]") beside the default ("ours") and the JAX peer in one process:
# ~1B fp16 B=1 / 4 ctx 1k, ~8B fp16 B=1 ctx 2k.
# To $OUT: prepare.log, e2e_1b.json, e2e_8b.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el e2e 1b
timeout 170 python3 -m jax_onnx_attn.bench e2e --phases decode --models 1b --weights fp16 --batch 1 4 \
  --ctx 1024 --impls ours jax-peer --ours-env kr:JOA_DECODE_KEY_ROWS=1 --profile none --no-verify \
  --max-seconds 160 --models-dir /tmp/models --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | grep -E "decode  |Error"
el e2e 8b
timeout 170 python3 -m jax_onnx_attn.bench e2e --phases decode --models 8b --weights fp16 --batch 1 \
  --ctx 2048 --impls ours jax-peer --ours-env kr:JOA_DECODE_KEY_ROWS=1 --profile none --no-verify \
  --max-seconds 160 --models-dir /tmp/models --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | grep -E "decode  |Error"
el done
} 2>&1 | tee "$out/run.log"
