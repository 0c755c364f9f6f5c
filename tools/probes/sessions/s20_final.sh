#!/usr/bin/env bash
# Session 20's last call (~9 min), at the landed commit: 1) the prefill GPU files (the persistent
# kernels now the default over <= 2048 key rows, so every short-prompt test runs them); 2) the prefill
# bench at the default (D 128 causal / not 1k-16k, jax cuDNN beside); 3) whole models: ~1B fp16 and
# int4 B=1 ctx 1k (prompt + decode, profiled), ~8B fp16 B=1 ctx 2k (prompt + decode).
# To $OUT: prepare.log, tests.log, pf.json, e2e_1b.json, e2e_8b.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 170 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider \
  tests/gpu/test_prefill_persistent_gpu.py tests/gpu/test_prefill_engine_gpu.py tests/gpu/test_prefill_route_gpu.py \
  tests/gpu/test_attention_prefill_route_gpu.py tests/gpu/test_prefill_split_gpu.py > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -2 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el prefill
timeout 80 python3 -m jax_onnx_attn.bench prefill --heads 32/8 --dtypes bf16 --tokens 16384 --dims 128 \
  --seqlens 1024 2048 4096 16384 --causal causal noncausal --target-ms 15 --reps 3 --max-seconds 65 \
  --impls ours jax-cudnn --out "$out/pf.json" 2>&1 | grep -v "us/" | tail -10
el e2e-1b
timeout 150 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 int4 --batch 1 --ctx 1024 \
  --phases prefill decode --impls ours jax-peer --profile first --max-seconds 130 --models-dir /tmp/models \
  --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -10
el e2e-8b
timeout 170 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 --batch 1 --ctx 2048 \
  --phases prefill decode --impls ours jax-peer --profile first --prefill-reps 3 --max-seconds 150 \
  --models-dir /tmp/models --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -8
el done
} 2>&1 | tee "$out/run.log"
