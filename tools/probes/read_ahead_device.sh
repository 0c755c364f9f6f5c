#!/usr/bin/env bash
# Session 38: the projections' read-ahead (GemvParams::l2_next: each one-row GEMV CTA past its last
# tile asks the L2 for its share of the next projection's weight; onnx.fusion pass 7,
# JOA_READ_AHEAD). Here: commit; bash tools/snapshot.sh --so <the .so>; carry .snap.
#   bash tools/probes/read_ahead_device.sh l2      # tools/probes/l2_prefetch.cu: a layer's kernels with / without
#   bash tools/probes/read_ahead_device.sh tests   # tests/gpu/test_read_ahead_gpu.py
#   bash tools/probes/read_ahead_device.sh e2e1b   # ~1B fp16 B=1 1k: ours / ours[ahead] / JAX peer
#   bash tools/probes/read_ahead_device.sh e2e8b   # ~8B fp16 B=1 2k: ours / ours[ahead] / JAX peer
# To $OUT: prepare.log, l2_prefetch.log, tests.log, e2e_*.json, run_*.log (at most 8 files: pick phases).
set -uo pipefail
phases=${*:-l2}
src=$PWD
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
E2E="python3 -m jax_onnx_attn.bench e2e --phases decode --reps 3 --models-dir /tmp/models"
for phase in $phases; do
{
case "$phase" in
  l2)
    el "L2 prefetch probe"
    nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -diag-suppress=940,2473,128 \
      -I ffi -I tools/probes tools/probes/l2_prefetch.cu ffi/kernels/gemv/inst/gemv_f16_dense.cu -o /tmp/l2_prefetch 2>&1 | grep -v Warn | tail -3
    JOA_PROBE_8B=1 timeout 120 /tmp/l2_prefetch 2>&1 | tee "$out/l2_prefetch.log" ;;
  tests)
    el "GPU tests"
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_read_ahead_gpu.py 2>&1 | tail -25 | tee "$out/tests.log" ;;
  e2e1b)
    el "e2e ~1B fp16 B=1 1k"
    timeout 300 $E2E --models 1b --weights fp16 --ctx 1024 --batch 1 --impls ours jax-peer --profile all \
      --ours-env ahead:JOA_READ_AHEAD=1 --max-seconds 280 \
      --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -10
    for i in ours "ours[ahead]"; do python3 -m jax_onnx_attn.bench breakdown --impl "$i" "$out/e2e_1b.json" 2>&1 | tail -11; done ;;
  e2e8b)
    el "e2e ~8B fp16 B=1 2k"
    timeout 330 $E2E --models 8b --weights fp16 --ctx 2048 --batch 1 --impls ours jax-peer \
      --ours-env ahead:JOA_READ_AHEAD=1 --max-seconds 310 --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -10 ;;
esac
el done
} 2>&1 | tee "$out/run_$phase.log"
done
