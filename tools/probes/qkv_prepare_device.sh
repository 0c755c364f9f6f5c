#!/usr/bin/env bash
# The fused QKV projection + step preparation (linear_gqa_prepare, on by default where the kernels
# run since c0e99df) on the H200, and its epilogue's read-ahead (session 35: the row's slot and the
# cos / sin lines fetched before the first tile instead of two L2 round trips after the last chunk).
# Here: bash tools/build_device_ext.sh; commit; bash tools/snapshot.sh --so <the .so>; carry .snap.
#   bash tools/probes/qkv_prepare_device.sh tests     # GPU tests (TEST_TIMEOUT, default 300 s)
#   bash tools/probes/qkv_prepare_device.sh 1b        # e2e ~1B fp16 / int4 B=1 1k
#   bash tools/probes/qkv_prepare_device.sh 8b        # e2e ~8B fp16 B=1 2k
#   bash tools/probes/qkv_prepare_device.sh 8b-record # the same under JOA_FFI_RECORD=1 (own process)
#   bash tools/probes/qkv_prepare_device.sh tests 1b  # several phases in one call, in order
# GPU tests: the fused op against the two launches it replaces (bits), donation, command buffer,
# sessions (test_long_run_gpu and test_prefill_route_gpu: with the switch on, not yet run at
# c0e99df's stop). The benches: ours (fused), ours[noqkv] (JOA_QKV_PREPARE=0: the plain projection
# and gqa_prepare) and the JAX peer in one process, profiled: `bench breakdown` on the JSON gives
# the "qkv + LM head" group's µs a step (session 34, before the read-ahead: fused ~8B 755.4 vs plain
# 725.8, ~1B 224.1 vs 214.8, int4 123.3 vs 116.0). To $OUT: prepare.log, gpu_tests.log, e2e_*.json,
# run_*.log.
set -uo pipefail
phases=${*:-tests}
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
AB="--batch 1 --phases decode --ours-env noqkv:JOA_QKV_PREPARE=0 --profile all --reps 3 --models-dir /tmp/models"
for phase in $phases; do
{
case "$phase" in
  tests)
    el "GPU tests"
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -ra -n 0 -p no:cacheprovider \
      tests/gpu/test_linear_gqa_prepare_gpu.py tests/gpu/test_session_gpu.py tests/gpu/test_long_run_gpu.py \
      tests/gpu/test_prefill_route_gpu.py > "$out/gpu_tests.log" 2>&1
    echo "rc $?"; tail -25 "$out/gpu_tests.log" ;;
  8b)
    el "e2e ~8B fp16 2k"
    timeout 300 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 --ctx 2048 --impls ours jax-peer $AB \
      --max-seconds 280 --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -25
    python3 -m jax_onnx_attn.bench breakdown "$out/e2e_8b.json" 2>&1 | tail -40 ;;
  8b-record)
    el "e2e ~8B fp16 2k, JOA_FFI_RECORD=1"
    JOA_FFI_RECORD=1 timeout 250 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 --ctx 2048 --impls ours \
      $AB --max-seconds 230 --out "$out/e2e_8b_record.json" 2>&1 | grep -v Warning | tail -25 ;;
  1b)
    el "e2e ~1B fp16 / int4 1k"
    timeout 500 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 int4 --ctx 1024 --impls ours jax-peer $AB \
      --max-seconds 460 --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -25
    python3 -m jax_onnx_attn.bench breakdown "$out/e2e_1b.json" 2>&1 | tail -60 ;;
esac
el done
} 2>&1 | tee "$out/run_$phase.log"
done
