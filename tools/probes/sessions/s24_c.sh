#!/usr/bin/env bash
# Session 24, third call (~9 min): the swizzled decode tiles (521caf6) and the re-fitted rows planner
# (b7ed430): GPU tests of the decode engine (every layout and option at f16, the quantised tile path),
# decode attention against jax cuDNN (fp16 32/8, B 8 / 1, ctx 2304-8192, d64 / d128; bf16 B 8 128k),
# then the ~8B int4 decoder (B=8 / 32, ctx 2k) beside the JAX peer, then the rows kernel's GPU tests.
# To $OUT: prepare.log, tests.log, dec.json, dec_long.json, e2e_int4.json, rows_tests.log, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 200 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_decode_attention_gpu.py \
  tests/gpu/test_decode_tile128_gpu.py tests/gpu/test_decode_producer_gpu.py tests/gpu/test_decode_quant_gpu.py \
  -k "not test_shapes or float16" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -2 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el decode
timeout 100 python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 8 1 \
  --ctx 2304 4096 8192 --qlen 1 --impls ours jax-cudnn --target-ms 20 --reps 5 --max-seconds 90 \
  --out "$out/dec.json" 2>&1 | grep -v "us/" | tail -14
timeout 40 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 8 \
  --ctx 131072 --qlen 1 --impls ours jax-cudnn --target-ms 20 --reps 3 --max-seconds 35 \
  --out "$out/dec_long.json" 2>&1 | grep -v "us/" | tail -3
el e2e
timeout 150 python3 -m jax_onnx_attn.bench e2e --models 8b --weights int4 --batch 8 32 --ctx 2048 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 140 --models-dir /tmp/models \
  --out "$out/e2e_int4.json" 2>&1 | grep -v Warning | grep "decode  "
el rows
timeout 100 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_linear_rows_gpu.py \
  > "$out/rows_tests.log" 2>&1
echo "rows tests rc $?"; tail -1 "$out/rows_tests.log"; grep -E "^(FAILED|ERROR)" "$out/rows_tests.log" | head -8
el done
} 2>&1 | tee "$out/run.log"
