#!/usr/bin/env bash
# Prepared in session 33 (no GPU was lent) for the next one: the fused QKV projection + step
# preparation (linear_gqa_prepare, JOA_QKV_PREPARE) on the H200.
# Here: bash tools/build_device_ext.sh; commit; bash tools/snapshot.sh --so <the .so>; carry .snap.
#   bash tools/probes/qkv_prepare_device.sh tests  # GPU tests (~4-6 min)
#   bash tools/probes/qkv_prepare_device.sh 8b     # e2e ~8B fp16 B=1 2k, then the same under JOA_FFI_RECORD=1
#   bash tools/probes/qkv_prepare_device.sh 1b     # e2e ~1B fp16 / int4 B=1 1k
#   bash tools/probes/qkv_prepare_device.sh tests 8b-plain   # several phases in one call, in order
# GPU tests: the fused op against the two launches it replaces (bits), donation, command buffer,
# sessions; gqa_prepare against its spec (prepare.cuh now shares the rotary with the epilogue:
# kernels/common/rotary.cuh). The benches: ours, ours[qkv] (JOA_QKV_PREPARE=1) and the JAX peer,
# profiled. JOA_FFI_RECORD is read once a process, so the record run is its own process: ours
# (record) and ours[qkv] (record + fused: the down -> next QKV edge node to node with PDL).
# To $OUT: prepare.log, gpu_tests.log, e2e_*.json, run_*.log.
set -uo pipefail
phases=${*:-tests}
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
AB="--batch 1 --phases decode --ours-env qkv:JOA_QKV_PREPARE=1 --profile all --reps 3 --models-dir /tmp/models"
for phase in $phases; do
{
case "$phase" in
  tests)
    el "GPU tests"
    timeout ${TEST_TIMEOUT:-560} python3 -m pytest -m gpu -q -ra -n 0 -p no:cacheprovider tests/gpu/test_linear_gqa_prepare_gpu.py \
      tests/gpu/test_session_gpu.py tests/gpu/test_gqa_prepare_gpu.py > "$out/gpu_tests.log" 2>&1
    echo "rc $?"; tail -25 "$out/gpu_tests.log" ;;
  8b|8b-plain)
    el "e2e ~8B fp16 2k"
    timeout 300 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 --ctx 2048 --impls ours jax-peer $AB \
      --max-seconds 280 --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -25
    if [ "$phase" = 8b ]; then
      el "e2e ~8B fp16 2k, JOA_FFI_RECORD=1"
      JOA_FFI_RECORD=1 timeout 250 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 --ctx 2048 --impls ours \
        $AB --max-seconds 230 --out "$out/e2e_8b_record.json" 2>&1 | grep -v Warning | tail -25
    fi ;;
  1b)
    el "e2e ~1B fp16 / int4 1k"
    timeout 500 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 int4 --ctx 1024 --impls ours jax-peer $AB \
      --max-seconds 460 --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -25 ;;
esac
el done
} 2>&1 | tee "$out/run_$phase.log"
done
