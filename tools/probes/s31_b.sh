#!/usr/bin/env bash
# Session 31, call B (~8 min): the whole steps of call A's winners, ours and its --ours-env forms in
# one process beside the JAX peer. PF=<distance> (0: skip): int4 B=1 (~1B ctx 1k, ~8B ctx 2k) with
# ours[pfN] (JOA_GEMV_L2_PREFETCH=N); SPEC=1: fp16 B=1 (~1B ctx 1k, ~8B ctx 2k) and ~8B B=8 with
# ours[spec] (JOA_DECODE_SPECULATE=1). To $OUT: prepare.log, e2e_*.json, run.log.
set -uo pipefail
PF=${PF:-0}; SPEC=${SPEC:-0}
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
e2e() {  # name, seconds, args...
  local name=$1 secs=$2; shift 2
  el "e2e $name"
  timeout $((secs + 10)) python3 -m jax_onnx_attn.bench e2e --phases decode --impls ours jax-peer --profile none \
    --max-seconds "$secs" --models-dir /tmp/models --out "$out/e2e_$name.json" "$@" 2>&1 | grep -v Warning | \
    grep -E "decode  |Error|token|Traceback" | head -20
}
{
if [ "$PF" != 0 ]; then
  e2e 1b_int4 90 --models 1b --weights int4 --batch 1 --ctx 1024 --ours-env "pf$PF:JOA_GEMV_L2_PREFETCH=$PF"
  e2e 8b_int4 170 --models 8b --weights int4 --batch 1 --ctx 2048 --ours-env "pf$PF:JOA_GEMV_L2_PREFETCH=$PF"
fi
if [ "$SPEC" = 1 ]; then
  e2e 1b_fp16 80 --models 1b --weights fp16 --batch 1 --ctx 1024 --ours-env spec:JOA_DECODE_SPECULATE=1
  e2e 8b_fp16 150 --models 8b --weights fp16 --batch 1 8 --ctx 2048 --ours-env spec:JOA_DECODE_SPECULATE=1
fi
el done
} 2>&1 | tee "$out/run.log"
