#!/usr/bin/env bash
# Session 27, call A (~9 min): 1) the vmap test (now with an int8 cache whose fold would change
# kernel); 2) the FFI record stage (GEMV kernel nodes with PDL edges, JOA_FFI_RECORD=1) at ~8B,
# never measured there: fp16 and int4 B=1 ctx 2k, record off (ours + the JAX peer) / on (ours), in
# separate processes (the switch is read once a process), off-on-off-on for fp16. To $OUT:
# prepare.log, tests.log, fp16_{off,on}{1,2}.json, int4_{off,on}.json (7 + run.log = 8 files).
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
run() {  # name, record (0 / 1), weights, timeout
  local name=$1 rec=$2 w=$3 t=$4 impls="ours jax-peer"
  [ "$rec" = 1 ] && impls="ours"
  JOA_FFI_RECORD=$rec timeout $t python3 -m jax_onnx_attn.bench e2e --phases decode --models 8b \
    --weights $w --batch 1 --ctx 2048 --impls $impls --profile none --no-verify \
    --max-seconds $((t - 10)) --models-dir /tmp/models --out "$out/$name.json" 2>&1 |
    grep -v Warning | grep -E "decode  |record|Error|error" | head -5
}
{
el tests
timeout 100 python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/gpu/test_spmd_gpu.py -k vmap > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -4
el fp16_off1; run fp16_off1 0 fp16 200
el fp16_on1; run fp16_on1 1 fp16 70
el fp16_off2; run fp16_off2 0 fp16 70
el fp16_on2; run fp16_on2 1 fp16 70
el int4_off; run int4_off 0 int4 130
el int4_on; run int4_on 1 int4 70
el done
} 2>&1 | tee "$out/run.log"
