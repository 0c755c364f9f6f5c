#!/usr/bin/env bash
# Session 24, fourth call (~5 min): whole steps at the landed kernels (swizzled decode tiles, 1280-byte
# rows stages, the re-fitted rows planner) where call three did not go: the ~8B fp16 decoder at B=8
# (where the JAX peer led) and the ~1B decoder (int4 B=8 / 32 ctx 1k, fp16 B=8 ctx 2k), each beside
# the JAX peer. To $OUT: prepare.log, e2e_8b_fp16.json, e2e_1b_int4.json, e2e_1b_fp16.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
run() {  # name, model, weights, batches, ctx, timeout
  timeout $6 python3 -m jax_onnx_attn.bench e2e --models $2 --weights $3 --batch $4 --ctx $5 \
    --phases decode --impls ours jax-peer --profile none --max-seconds $(( $6 - 10 )) --models-dir /tmp/models \
    --out "$out/$1.json" 2>&1 | grep -v Warning | grep "decode  "
}
{
el 8b-fp16; run e2e_8b_fp16 8b fp16 8 2048 130
el 1b-int4; run e2e_1b_int4 1b int4 "8 32" 1024 90
el 1b-fp16; run e2e_1b_fp16 1b fp16 8 2048 70
el done
} 2>&1 | tee "$out/run.log"
