#!/usr/bin/env bash
# Session 35 (no GPU was lent): the dense row kernel for 2-8 rows of x (ffi/kernels/gemv/dense_row.cuh,
# kRows 4 / 8), off by default (JOA_GEMV_DENSE_ROWS=1); this measures whether a decode session of
# batch 2-8 should keep its dense weights [N, K] and run its projections there, with the norm / SiLU /
# residual fused, instead of XLA's GEMM on [K, N] and XLA's separate fusions (~9 µs a layer at ~1B B=8,
# session 26's in-graph profile).
# Here: bash tools/build_device_ext.sh; commit; bash tools/snapshot.sh --so <the .so>; carry .snap.
#   bash tools/probes/dense_rows_device.sh tests      # GPU tests (TEST_TIMEOUT, default 300 s)
#   bash tools/probes/dense_rows_device.sh linear     # bench linear fp16 M 1 4 8: ours (rows) / ours (ring) / XLA
#   bash tools/probes/dense_rows_device.sh 1b         # e2e ~1B fp16 B=4 / 8 1k, ours vs ours[rows8] vs peer
#   bash tools/probes/dense_rows_device.sh 8b         # e2e ~8B fp16 B=8 2k
# GPU tests: the rows against the reference and each row alone (same bits), a batch-4 session on the
# kernel against the reference session; the one-row kernel's tests (its M = 1 path was touched); the
# fused QKV epilogue's read-ahead (test_linear_gqa_prepare_gpu: same bits as the unfused launches).
# To $OUT: prepare.log, gpu_tests.log, linear_*.json, e2e_*.json, run_*.log.
set -uo pipefail
phases=${*:-tests}
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
AB="--phases decode --ours-env rows8:JOA_GEMV_DENSE_ROWS=8 --profile all --reps 3 --models-dir /tmp/models"
for phase in $phases; do
{
case "$phase" in
  tests)
    el "GPU tests"
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -ra -n 0 -p no:cacheprovider \
      tests/gpu/test_linear_gpu.py -k "dense_row" tests/gpu/test_session_gpu.py \
      tests/gpu/test_linear_gqa_prepare_gpu.py > "$out/gpu_tests.log" 2>&1
    echo "rc $?"; tail -25 "$out/gpu_tests.log" ;;
  linear)
    el "bench linear fp16 M 1 4 8"
    JOA_GEMV_DENSE_ROWS=8 timeout 200 python3 -m jax_onnx_attn.bench linear --formats fp16 --rows 1 4 8 \
      --impls ours xla-kn xla-nk --max-seconds 180 --out "$out/linear_rows.json" 2>&1 | tail -30
    timeout 150 python3 -m jax_onnx_attn.bench linear --formats fp16 --rows 4 8 --impls ours \
      --max-seconds 130 --out "$out/linear_ring.json" 2>&1 | tail -20 ;;
  1b)
    el "e2e ~1B fp16 1k B=4 8"
    timeout 420 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 --ctx 1024 --batch 4 8 \
      --impls ours jax-peer $AB --max-seconds 400 --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -25
    for i in ours "ours[rows8]" jax-peer; do python3 -m jax_onnx_attn.bench breakdown --impl "$i" "$out/e2e_1b.json" 2>&1 | tail -26; done ;;
  8b)
    el "e2e ~8B fp16 2k B=8"
    timeout 420 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 --ctx 2048 --batch 8 \
      --impls ours jax-peer $AB --max-seconds 400 --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -25
    for i in ours "ours[rows8]" jax-peer; do python3 -m jax_onnx_attn.bench breakdown --impl "$i" "$out/e2e_8b.json" 2>&1 | tail -13; done ;;
esac
el done
} 2>&1 | tee "$out/run_$phase.log"
done
