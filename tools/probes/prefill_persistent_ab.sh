#!/usr/bin/env bash
# The prefill engine's persistent kernels (issue 14, engine.cuh RunPersistent), ~6 min: first the
# GPU tests (tests/gpu/test_prefill_persistent_gpu.py: persistent bitwise equal to one tile a CTA,
# both against the spec; then the engine's d128 / d64 tests, unchanged kernels), then the prefill
# bench A/B "ours-nopersistent" (one tile a CTA, "ours" while the default is off) against
# "ours-persistent", jax cuDNN the anchor: bf16 32/8, B·S 16k, D 128 causal and not at S 1k / 2k /
# 4k / 16k; D 64 and D 256 (not persistent: its tiling holds one Q tile; a control) at 4k.
# To $OUT: prepare.log, gpu_tests.log, pf_d128.json, pf_d64_d256.json, bench.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
unset JOA_PREFILL_PERSISTENT
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el tests
timeout 150 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider \
  tests/gpu/test_prefill_persistent_gpu.py tests/gpu/test_prefill_engine_gpu.py -k "persistent or d128 or d64" \
  2>&1 | tail -40 | tee "$out/gpu_tests.log"
{
el d128
timeout 130 python3 -m jax_onnx_attn.bench prefill --heads 32/8 --dtypes bf16 --tokens 16384 --dims 128 \
  --seqlens 1024 2048 4096 16384 --causal causal noncausal --target-ms 20 --reps 5 --max-seconds 110 \
  --impls ours-nopersistent ours-persistent jax-cudnn --out "$out/pf_d128.json" 2>&1 | grep -v "us/" | tail -16
el d64-d256
timeout 70 python3 -m jax_onnx_attn.bench prefill --heads 32/8 --dtypes bf16 --tokens 16384 --dims 64 256 \
  --seqlens 4096 --causal causal noncausal --target-ms 20 --reps 5 --max-seconds 55 \
  --impls ours-nopersistent ours-persistent jax-cudnn --out "$out/pf_d64_d256.json" 2>&1 | grep -v "us/" | tail -10
el done
} > "$out/bench.log" 2>&1
cat "$out/bench.log"
