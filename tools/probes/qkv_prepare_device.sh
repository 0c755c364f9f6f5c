#!/usr/bin/env bash
# Prepared in session 33 (no GPU was lent) for the next one: the fused QKV projection + step
# preparation (linear_gqa_prepare, JOA_QKV_PREPARE) on the H200, in one call (~8-9 min).
# Here: bash tools/build_device_ext.sh; commit; bash tools/snapshot.sh --so <the .so>; carry .snap.
# There: (1) the GPU tests of what changed: the fused op against the two launches it replaces (bits),
# donation, command buffer, sessions; gqa_prepare against its spec (prepare.cuh now shares the
# rotary with the epilogue: kernels/common/rotary.cuh); (2) if they pass, bench e2e B=1 with ours,
# ours[qkv] (JOA_QKV_PREPARE=1) and the JAX peer, profiled: ~8B fp16 2k, ~1B fp16 and int4 1k.
# To $OUT: prepare.log, gpu_tests.log, e2e_8b.json, e2e_1b.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el "GPU tests"
timeout 240 python3 -m pytest -m gpu -q -ra -n 0 -p no:cacheprovider tests/gpu/test_linear_gqa_prepare_gpu.py \
  tests/gpu/test_gqa_prepare_gpu.py tests/gpu/test_session_gpu.py > "$out/gpu_tests.log" 2>&1
rc=$?; tail -25 "$out/gpu_tests.log"
if [ $rc -ne 0 ]; then el "GPU tests failed (rc $rc): no bench"; exit 0; fi
AB="--batch 1 --phases decode --impls ours jax-peer --ours-env qkv:JOA_QKV_PREPARE=1 --profile all --reps 3"
el "e2e ~8B fp16 2k"
timeout 270 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 --ctx 2048 $AB \
  --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -25
el "e2e ~1B fp16 / int4 1k"
timeout 200 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 int4 --ctx 1024 $AB \
  --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -25
el done
} 2>&1 | tee "$out/run.log"
