#!/usr/bin/env bash
# Session 25, third call (~8 min): whole steps with the one-trip combine (split_merge.cuh) beside
# the JAX peer: ~8B int4 B=8 / 32 and ~1B int4 B=8 (the rows kernels), ~1B / ~8B fp16 B=8 (XLA's
# GEMMs; the ~8B verify checks the fp16 token split again).
# To $OUT: prepare.log, e2e_8b_int4.json, e2e_1b_int4.json, e2e_1b_fp16.json, e2e_8b_fp16.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
run() {  # name, then bench e2e arguments
  local name=$1; shift
  timeout 170 python3 -m jax_onnx_attn.bench e2e "$@" --phases decode --impls ours jax-peer --profile none \
    --max-seconds 160 --models-dir /tmp/models --out "$out/$name.json" 2>&1 | grep -v Warning | grep -E "decode  |verify"
}
{
el 8b_int4; run e2e_8b_int4 --models 8b --weights int4 --batch 8 32 --ctx 2048
el 1b; run e2e_1b_int4 --models 1b --weights int4 --batch 8 --ctx 1024
run e2e_1b_fp16 --models 1b --weights fp16 --batch 8 --ctx 2048
el 8b_fp16; run e2e_8b_fp16 --models 8b --weights fp16 --batch 8 --ctx 2048
el done
} 2>&1 | tee "$out/run.log"
