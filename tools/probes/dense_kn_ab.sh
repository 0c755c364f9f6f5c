#!/usr/bin/env bash
# The [K, N] dense layout of sessions of 2+ rows (88f9749, runtime.session.dense_layout_for) timed
# whole, both arms in one call (~8 min): fp16 decoders at B=8 / 32, ours ([K, N], the default) beside
# ours[nk] (JOA_DENSE_KN=0, the [N, K] layout) and the JAX peer; then a ~1B B=8 prefill (the
# compute-bound GEMMs on either layout), after the batched session's GPU test. To $OUT: prepare.log, e2e_1b.json, e2e_8b.json,
# prefill_1b.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
run() {  # name, phases, then bench e2e arguments
  local name=$1 phases=$2; shift 2
  timeout 175 python3 -m jax_onnx_attn.bench e2e "$@" --phases $phases --impls ours jax-peer \
    --ours-env nk:JOA_DENSE_KN=0 --profile none --max-seconds 165 --models-dir /tmp/models \
    --out "$out/$name.json" 2>&1 | grep -v Warning | grep -E "decode  |prefill  |verify"
}
{
el session-test; timeout 90 python3 -m pytest -q -m gpu tests/gpu/test_session_gpu.py -k kn 2>&1 | tail -4
el 1b; run e2e_1b decode --models 1b --weights fp16 --batch 8 32 --ctx 2048
el 8b; run e2e_8b decode --models 8b --weights fp16 --batch 8 32 --ctx 2048
el prefill; run prefill_1b prefill --models 1b --weights fp16 --batch 8 --ctx 1024
el done
} 2>&1 | tee "$out/run.log"
