#!/usr/bin/env bash
# Session 26, call B (~8 min): int8 / int4 caches dequantised in registers at three CTAs an SM
# (plan.h MakeLayout; was two). 1) GPU tests of the register path (values vs the reference, bitwise
# repeatability); 2) issue 15's decode grid (bf16 / int8 / int4, B 1 / 8, ctx 4k / 8k / 128k,
# 32/8 d128; ours, ours[tiles] (the shared-memory path) and jax cuDNN); 3) ~1B fp16 B=8 prefill with
# the [K, N] layout against [N, K] again (call A: 29.1 vs 28.0 ms). To $OUT: prepare.log, dec.json,
# prefill_1b.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 200 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_decode_quant_regs_gpu.py tests/gpu/test_decode_quant_gpu.py 2>&1 | tail -4
el decode
timeout 200 python3 -m jax_onnx_attn.bench decode --batch 1 8 --ctx 4096 8192 131072 --qlen 1 --heads 32/8 --dims 128 \
  --dtypes bf16 --kv-bits 0 8 4 --impls ours ours[tiles] jax-cudnn --target-ms 10 --reps 3 --max-seconds 180 \
  --out "$out/dec.json" 2>&1 | grep -v Warning | tail -30
el prefill
timeout 120 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 --batch 8 --ctx 1024 --phases prefill \
  --impls ours jax-peer --ours-env nk:JOA_DENSE_KN=0 --profile none --max-seconds 110 --models-dir /tmp/models \
  --out "$out/prefill_1b.json" 2>&1 | grep -v Warning | grep -E "prefill  |verify"
el done
} 2>&1 | tee "$out/run.log"
