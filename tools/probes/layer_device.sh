#!/usr/bin/env bash
# A batch-1 decode layer's kernels on the GPU machine: the gated MLP as one kernel (session 37:
# ffi/kernels/gemv/mlp_row.cuh, JOA_GATED_MLP) and whole-step A/Bs of --ours-env variants (session
# 38 ran the read-ahead of tools/patches/read-ahead/ with it). Here: commit; bash tools/snapshot.sh
# --so <the .so>; carry .snap. Phases (any of, in order):
#   mlp-probe     tools/probes/mlp_row.cu: the fused MLP (K and N splits) vs the two dense row GEMVs, ~1B / ~8B
#   chain-probe   tools/probes/layer_chain.cu: o + gate-up + down + qkv as one persistent kernel (session 39)
#                 vs the separate kernels (4 GEMVs; o + fused MLP + qkv), ~1B / ~8B
#   mlp-tests     tests/gpu/test_gated_mlp_gpu.py
#   chain-tests   tests/gpu/test_out_mlp_gpu.py (o + the MLP as one chain kernel, JOA_OUT_MLP)
#   e2e1b         ~1B B=1 1k: ours / ours[VARIANT] ... / JAX peer, breakdowns (VARIANTS, below)
#   e2e8b         ~8B B=1 2k: the same, profiled only with PROFILE_8B=first / all (then breakdowns)
# WEIGHTS: the e2e phases' weights, fp16 (default) or int4;
# VARIANTS: --ours-env specs, default: the fused MLP off (ours has it on since session 39);
# ROUNDS: bench e2e --rounds (default 1);
# E2E_TIMEOUT: seconds for an e2e phase (default 300 / 330; ROUNDS=3 with four impls wants ~540, alone in a call).
# To $OUT: prepare.log, mlp_row.log, layer_chain.log, tests_mlp.log, tests_chain.log, e2e_*.json, run_*.log (at most 8 files: pick phases).
set -uo pipefail
phases=${*:-mlp-probe}
variants=${VARIANTS:-nomlp:JOA_GATED_MLP=0}
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
NVCC="nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -diag-suppress=940,2473,128 -I ffi -I tools/probes"
E2E="python3 -m jax_onnx_attn.bench e2e --phases decode --reps 3 --rounds ${ROUNDS:-1} --models-dir /tmp/models --impls ours jax-peer --ours-env $variants"
for phase in $phases; do
{
el "$phase"
case "$phase" in
  mlp-probe)
    $NVCC tools/probes/mlp_row.cu ffi/kernels/gemv/inst/gemv_f16_dense.cu -o /tmp/mlp_row 2>&1 | grep -v Warn | tail -3
    JOA_PROBE_8B=1 timeout 200 /tmp/mlp_row 2>&1 | tee "$out/mlp_row.log" ;;
  chain-probe)
    $NVCC tools/probes/layer_chain.cu ffi/kernels/gemv/inst/gemv_f16_dense.cu -o /tmp/layer_chain 2>&1 | grep -v Warn | tail -3
    JOA_PROBE_8B=1 timeout 200 /tmp/layer_chain 2>&1 | tee "$out/layer_chain.log" ;;
  mlp-tests)
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gated_mlp_gpu.py 2>&1 | tail -25 |
      tee "$out/tests_mlp.log" ;;
  chain-tests)
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_out_mlp_gpu.py 2>&1 | tail -25 |
      tee "$out/tests_chain.log" ;;
  e2e1b)
    timeout ${E2E_TIMEOUT:-300} $E2E --models 1b --weights ${WEIGHTS:-fp16} --ctx 1024 --batch 1 --profile all \
      --max-seconds $(( ${E2E_TIMEOUT:-300} - 20 )) \
      --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -10
    for i in ours $(for v in $variants; do echo "ours[${v%%:*}]"; done); do
      python3 -m jax_onnx_attn.bench breakdown --impl "$i" "$out/e2e_1b.json" 2>&1 | tail -11
    done ;;
  e2e8b)
    timeout ${E2E_TIMEOUT:-330} $E2E --models 8b --weights ${WEIGHTS:-fp16} --ctx 2048 --batch 1 --profile ${PROFILE_8B:-none} \
      --max-seconds $(( ${E2E_TIMEOUT:-330} - 20 )) \
      --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -10
    if [ "${PROFILE_8B:-none}" != none ]; then
      for i in ours $(for v in $variants; do echo "ours[${v%%:*}]"; done); do
        python3 -m jax_onnx_attn.bench breakdown --impl "$i" "$out/e2e_8b.json" 2>&1 | tail -11
      done
    fi ;;
  *) echo "unknown phase $phase" ;;
esac
el done
} 2>&1 | tee "$out/run_$phase.log"
done
