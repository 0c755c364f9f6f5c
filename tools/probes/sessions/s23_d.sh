#!/usr/bin/env bash
# Session 23, fourth call (~5 min): the decode plan's default rule A/B in the whole step, the ~8B
# decoder at ctx 2k B=8: JOA_DECODE_PLAN=ladder (the old default) beside the JAX peer, then the
# default (fit at this shape), fp16 then int4, one process each.
# To $OUT: prepare.log, fp16_ladder.json, fp16_default.json, int4_ladder.json, int4_default.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
run() {  # name, weights, impls, env
  env $4 timeout 100 python3 -m jax_onnx_attn.bench e2e --models 8b --weights $2 --batch 8 --ctx 2048 \
    --phases decode --impls $3 --profile none --no-verify --max-seconds 90 --models-dir /tmp/models \
    --out "$out/$1.json" 2>&1 | grep -v Warning | grep "decode  "
}
{
el fp16; run fp16_ladder fp16 "ours jax-peer" JOA_DECODE_PLAN=ladder; run fp16_default fp16 ours JOA_X=1
el int4; run int4_ladder int4 "ours jax-peer" JOA_DECODE_PLAN=ladder; run int4_default int4 ours JOA_X=1
el done
} 2>&1 | tee "$out/run.log"
