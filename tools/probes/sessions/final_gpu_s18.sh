#!/usr/bin/env bash
# Session 18's last call (~6.5 min), after the D 64 default flip (pingpong-fold-lazy-m192-s4) and the
# few-query rule (>= 64 packed rows on the prefill engine): GPU tests again (split-KV now runs the
# three-consumer kernels at D 64), the D 64 prefill bench at the default, the few-query decode and
# split sweeps at D 64, and the ~1B fp16 decoder (head dim 64: its prompts run the new default).
# To $OUT: prepare.log, tests.log, d64.json, fewq64.json, split64.json, e2e_1b.json.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el tests
timeout 200 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider \
  tests/gpu/test_prefill_split_gpu.py tests/gpu/test_decode_fewquery_gpu.py \
  tests/gpu/test_prefill_route_gpu.py tests/gpu/test_attention_prefill_route_gpu.py \
  tests/gpu/test_prefill_engine_gpu.py -k "not test_prefill_engine_gpu or d64" > "$out/tests.log" 2>&1
echo "tests: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -25
el d64
timeout 60 python3 -m jax_onnx_attn.bench prefill --heads 32/8 --dtypes bf16 --tokens 16384 --dims 64 \
  --seqlens 1024 2048 4096 --causal causal noncausal --target-ms 15 --reps 3 --max-seconds 50 \
  --impls ours ours-pingpong jax-cudnn torch-cudnn --out "$out/d64.json" 2>&1 | tail -7
el fewq64
timeout 50 python3 -m jax_onnx_attn.bench decode --batch 1 8 --ctx 4096 32768 --qlen 4 16 --heads 32/8 \
  --dims 64 --dtypes bf16 --impls ours ours[decode-engine] ours[prefill-engine] --target-ms 10 --reps 3 \
  --max-seconds 45 --out "$out/fewq64.json" 2>&1 | tail -10
timeout 30 python3 -m jax_onnx_attn.bench prefill --chunked 16:32768 --chunk-batch 8 --heads 32/8 --dims 64 \
  --dtypes bf16 --causal causal --impls ours ours-nosplit jax-cudnn --target-ms 15 --reps 3 \
  --out "$out/split64.json" 2>&1 | tail -3
el e2e
timeout 120 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 --batch 1 --ctx 4096 \
  --max-prefill-tokens 4096 --max-seconds 100 --impls ours jax-peer --phases prefill decode \
  --models-dir /tmp/models --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -14
el done
