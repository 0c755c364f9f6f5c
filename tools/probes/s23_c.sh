#!/usr/bin/env bash
# Session 23, third call (~5 min): the decode plan's default rule (cuda._default_plan_policy: fit
# where the ladder needs the combine kernel at d128). 1) GPU tests of the decode engine's cluster
# and fit plans; 2) the ~8B decoder at ctx 2k, B=8, int4 and fp16, beside the JAX peer.
# To $OUT: prepare.log, tests.log, e2e_8b_int4.json, e2e_8b_fp16.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 100 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_decode_attention_gpu.py \
  -k "fit or cluster or combine" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -2 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el e2e
timeout 110 python3 -m jax_onnx_attn.bench e2e --models 8b --weights int4 --batch 8 --ctx 2048 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 100 --models-dir /tmp/models \
  --out "$out/e2e_8b_int4.json" 2>&1 | grep -v Warning | grep "decode\|total"
timeout 130 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 --batch 8 --ctx 2048 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 120 --models-dir /tmp/models \
  --out "$out/e2e_8b_fp16.json" 2>&1 | grep -v Warning | grep "decode\|total"
el done
} 2>&1 | tee "$out/run.log"
