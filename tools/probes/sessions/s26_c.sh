#!/usr/bin/env bash
# Session 26, call C (~9 min): the decode kernels' whole-tile branch (a tile every row sees skips the
# per-key mask tests; engine.cuh and engine_qregs.cuh, same bits) on top of call B's three CTAs an
# SM for register-dequantised caches. 1) GPU tests: the decode engine (all but the shape sweep, plus
# f16 d128), its paths, quantised caches both ways, NaN / Inf; 2) decode attention against jax cuDNN
# (fp16 32/8, d64 / d128, B 8 / 1, ctx 2k-8k; bf16 d128 128k); 3) the register path against the tile
# path for int8 / int4 caches, B 1-8, ctx 2k-32k (which should run where). To $OUT: prepare.log,
# tests.log, dec.json, dec128k.json, quant.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 260 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_decode_attention_gpu.py \
  tests/gpu/test_decode_paths_gpu.py tests/gpu/test_decode_quant_regs_gpu.py tests/gpu/test_decode_quant_gpu.py \
  tests/gpu/test_nan_inf_gpu.py -k "not test_shapes or (float16 and 128)" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el decode
timeout 90 python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 8 1 \
  --ctx 2048 4096 8192 --qlen 1 --impls ours jax-cudnn --target-ms 20 --reps 5 --max-seconds 80 \
  --out "$out/dec.json" 2>&1 | grep -v "us/" | tail -14
timeout 60 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 8 1 \
  --ctx 131072 --qlen 1 --kv-bits 0 8 4 --impls ours jax-cudnn --target-ms 10 --reps 3 --max-seconds 50 \
  --out "$out/dec128k.json" 2>&1 | grep -v "us/" | tail -8
el quant
timeout 120 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 1 2 4 8 \
  --ctx 2048 4096 8192 16384 32768 --qlen 1 --kv-bits 8 4 --impls ours ours[tiles] --target-ms 10 --reps 3 \
  --max-seconds 110 --out "$out/quant.json" 2>&1 | grep -v "us/" | tail -44
el done
} 2>&1 | tee "$out/run.log"
