#!/usr/bin/env bash
# Session 32, call E (~6 min): issue 15's figures at the landed commit with the device time a call
# beside the wall-clock one (bench decode --device-time): 1) the decode GPU tests; 2) bf16 32/8
# d128, B 1 / 8, ctx 4k / 8k / 128k, ours and jax cuDNN; 3) B=8 128k bf16 / int8 / int4 caches, ours.
# `s32_e.sh tests` (call F, ~5 min): only the tests, with the 330 s they need (170 s cut call E's).
# To $OUT: prepare.log, tests.log, dec.json, dec_int.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
only_tests=$([ "${1:-}" = tests ] && echo 1 || echo 0)
timeout $([ $only_tests = 1 ] && echo 330 || echo 170) python3 -m pytest -m gpu -q -ra -n $([ $only_tests = 1 ] && echo 12 || echo 8) \
  --dist load -p no:cacheprovider \
  tests/gpu/test_decode_attention_gpu.py tests/gpu/test_decode_quant_regs_gpu.py > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
[ $only_tests = 1 ] && { el done; exit 0; }
el bf16
timeout 170 python3 -m jax_onnx_attn.bench decode --batch 1 8 --ctx 4096 8192 131072 --qlen 1 --heads 32/8 \
  --dims 128 --dtypes bf16 --impls ours jax-cudnn --device-time --target-ms 20 --reps 5 --max-seconds 150 \
  --out "$out/dec.json" 2>&1 | grep -v Warn | tail -22
el int
timeout 90 python3 -m jax_onnx_attn.bench decode --batch 8 --ctx 131072 --qlen 1 --heads 32/8 --dims 128 \
  --dtypes bf16 --kv-bits 0 8 4 --impls ours --device-time --target-ms 20 --reps 3 --max-seconds 80 \
  --out "$out/dec_int.json" 2>&1 | grep -v Warn | tail -12
el done
} 2>&1 | tee "$out/run.log"
