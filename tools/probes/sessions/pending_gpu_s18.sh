#!/usr/bin/env bash
# Session 18's verification call (~8 min), outputs straight to $OUT, in priority order:
# 1) GPU tests of what the session merged: prefill split-KV (test_prefill_split_gpu.py), the D 64
#    tuned schedules (test_prefill_engine_gpu.py -k "tuned and d64"), few-query decode steps on the
#    prefill engine (test_decode_fewquery_gpu.py), the prompt routes (test_prefill_route_gpu.py,
#    test_attention_prefill_route_gpu.py);
# 2) bench prefill at d64: the new schedules vs ours (pingpong) and cuDNN (the default flip);
# 3) bench prefill split-KV: few-query and chunked cases at B 8 and 1, ours (the plan) vs
#    ours-nosplit and jax cuDNN;
# 4) bench decode: the decode engine vs the prefill engine (split-KV on) at few-query shapes (the
#    decode_engine rule on the H200).
# Build and carry the snapshot first (tools/build_device_ext.sh; tools/snapshot.sh --so <.so>).
# To $OUT: prepare.log, tests.log, d64.json, split.json, fewq.json, log.txt.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el tests
timeout 230 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider \
  tests/gpu/test_prefill_split_gpu.py tests/gpu/test_decode_fewquery_gpu.py \
  tests/gpu/test_prefill_route_gpu.py tests/gpu/test_attention_prefill_route_gpu.py \
  "tests/gpu/test_prefill_engine_gpu.py" -k "not test_prefill_engine_gpu or (tuned and d64)" > "$out/tests.log" 2>&1
echo "tests: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -25
el d64
timeout 120 python3 -m jax_onnx_attn.bench prefill --heads 32/8 --dtypes bf16 --tokens 16384 --dims 64 \
  --seqlens 1024 4096 --causal causal noncausal --target-ms 15 --reps 3 --max-seconds 100 \
  --impls ours ours-pingpong-fold-lazy ours-pingpong-fold-lazy-s4 ours-pingpong-fold-lazy-n192 \
          ours-pingpong-fold-lazy-n192-s4 ours-pingpong-fold-lazy-m192 ours-pingpong-fold-lazy-m192-s4 \
          jax-cudnn torch-cudnn --out "$out/d64.json" 2>&1 | tail -6
el split
timeout 90 python3 -m jax_onnx_attn.bench prefill --chunked 16:32768 64:32768 2048:32768 16:4096 --chunk-batch 8 \
  --heads 32/8 --dims 128 --dtypes bf16 --causal causal --impls ours ours-nosplit jax-cudnn --target-ms 15 --reps 3 \
  --out "$out/split.json" 2>&1 | tail -6
timeout 60 python3 -m jax_onnx_attn.bench prefill --chunked 16:32768 64:32768 2048:32768 --chunk-batch 1 \
  --heads 32/8 --dims 128 --dtypes bf16 --causal causal --impls ours ours-nosplit jax-cudnn --target-ms 15 --reps 3 \
  --out "$out/split_b1.json" 2>&1 | tail -5
el fewq
timeout 120 python3 -m jax_onnx_attn.bench decode --batch 1 8 --ctx 4096 32768 --qlen 4 16 32 --heads 32/8 \
  --dims 128 64 --dtypes bf16 --impls ours[decode-engine] ours[prefill-engine] jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 110 --out "$out/fewq.json" 2>&1 | tail -28
el done
