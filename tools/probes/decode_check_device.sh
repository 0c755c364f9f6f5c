#!/usr/bin/env bash
# Session 36: the decode loop's blocks of fixed-count steps (DecoderSession steps_per_check,
# $JOA_DECODE_STEPS_PER_CHECK). Before, every step ended in XLA's while-loop predicate copied to
# the host (the GPU idle ~65-80 µs a step at ~1B, H100 profiles); now once a block of 8.
# Here: commit; bash tools/snapshot.sh --so <the .so of the same C++>; carry .snap.
#   bash tools/probes/decode_check_device.sh tests   # test_long_run_gpu + test_session_gpu (TEST_TIMEOUT, 200 s)
#   bash tools/probes/decode_check_device.sh 1b      # e2e ~1B fp16 B=1 / 8 and int4 B=1 1k
#   bash tools/probes/decode_check_device.sh 8b      # e2e ~8B fp16 B=1 / 8 2k
# Each: ours (8 steps a check), ours[check1] (a check a step: the loop before), ours[check16] (one
# block a call of --steps 16; 1b only) and the JAX peer, profiled (`bench breakdown`: idle a step).
# To $OUT: prepare.log, gpu_tests.log, e2e_*.json, run_*.log.
set -uo pipefail
phases=${*:-tests}
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
AB="--phases decode --profile all --reps 3 --models-dir /tmp/models"
for phase in $phases; do
{
case "$phase" in
  tests)
    el "GPU tests"
    timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu -q -ra -n 0 -p no:cacheprovider \
      tests/gpu/test_long_run_gpu.py tests/gpu/test_session_gpu.py > "$out/gpu_tests.log" 2>&1
    echo "rc $?"; tail -15 "$out/gpu_tests.log" ;;
  1b)
    el "e2e ~1B 1k"
    timeout 330 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 int4 --ctx 1024 --batch 1 8 \
      --impls ours jax-peer --ours-env check1:JOA_DECODE_STEPS_PER_CHECK=1 check16:JOA_DECODE_STEPS_PER_CHECK=16 \
      $AB --max-seconds 310 --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -22
    for i in ours "ours[check1]" "ours[check16]" jax-peer; do
      python3 -m jax_onnx_attn.bench breakdown --impl "$i" "$out/e2e_1b.json" 2>&1 | grep -E "e2e_|^kernels|idle|step \(timed"; done ;;
  8b)
    el "e2e ~8B 2k"
    timeout 330 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 --ctx 2048 --batch 1 8 \
      --impls ours jax-peer --ours-env check1:JOA_DECODE_STEPS_PER_CHECK=1 \
      $AB --max-seconds 310 --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -16
    for i in ours "ours[check1]" jax-peer; do
      python3 -m jax_onnx_attn.bench breakdown --impl "$i" "$out/e2e_8b.json" 2>&1 | grep -E "e2e_|^kernels|idle|step \(timed"; done ;;
esac
el done
} 2>&1 | tee "$out/run_$phase.log"
done
