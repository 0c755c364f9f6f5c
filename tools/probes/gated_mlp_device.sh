#!/usr/bin/env bash
# Session 37: the gated MLP of a batch-1 decode step as one kernel (ffi/kernels/gemv/mlp_row.cuh,
# ops.gated_mlp, onnx.fusion pass 4b). Here: commit; bash tools/snapshot.sh --so <the .so>; carry .snap.
#   bash tools/probes/gated_mlp_device.sh probe    # tools/probes/mlp_row.cu: fused vs the two dense row GEMVs, ~1B / ~8B
#   bash tools/probes/gated_mlp_device.sh tests    # tests/gpu/test_gated_mlp_gpu.py
#   bash tools/probes/gated_mlp_device.sh e2e1b    # e2e ~1B fp16 B=1 1k: ours / ours[mlp] (JOA_GATED_MLP=1) / JAX peer
#   bash tools/probes/gated_mlp_device.sh e2e8b    # e2e ~8B fp16 B=1 2k: ours / ours[mlp] / JAX peer
# To $OUT: prepare.log, mlp_row.log, tests.log, e2e_*.json, run_*.log (at most 8 files: pick phases).
set -uo pipefail
phases=${*:-probe}
src=$PWD
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
E2E="python3 -m jax_onnx_attn.bench e2e --phases decode --reps 3 --models-dir /tmp/models"
for phase in $phases; do
{
case "$phase" in
  probe)
    el "probe"
    nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -diag-suppress=940,2473,128 \
      -I ffi -I tools/probes tools/probes/mlp_row.cu ffi/kernels/gemv/inst/gemv_f16_dense.cu -o /tmp/mlp_row 2>&1 | grep -v Warn | tail -3
    JOA_PROBE_8B=1 timeout 200 /tmp/mlp_row 2>&1 | tee "$out/mlp_row.log" ;;
  tests)
    el "GPU tests"
    timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gated_mlp_gpu.py 2>&1 | tail -25 | tee "$out/tests.log" ;;
  e2e1b)
    el "e2e ~1B fp16 B=1 1k"
    timeout 280 $E2E --models 1b --weights fp16 --ctx 1024 --batch 1 --impls ours jax-peer --profile all \
      --ours-env mlp:JOA_GATED_MLP=1 --max-seconds 260 --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -10
    for i in ours "ours[mlp]"; do python3 -m jax_onnx_attn.bench breakdown --impl "$i" "$out/e2e_1b.json" 2>&1 | tail -13; done ;;
  e2e8b)
    el "e2e ~8B fp16 B=1 2k"
    timeout 330 $E2E --models 8b --weights fp16 --ctx 2048 --batch 1 --impls ours jax-peer \
      --ours-env mlp:JOA_GATED_MLP=1 --max-seconds 310 --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -10 ;;
esac
el done
} 2>&1 | tee "$out/run_$phase.log"
done
