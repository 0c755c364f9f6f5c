#!/usr/bin/env bash
# Session 28, call E (~3 min): the B=1 rule's splits spread over 16 CTAs a head up to 16 tiles
# (plan.h LongSplitTiles): 1) the GPU tests of the B=1 plans; 2) B=1 d128 decode, ours beside
# ours[ladder] and cuDNN, fp16 / bf16 at 4k / 8k / 16k. To $OUT: prepare.log, tests.log, dec.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 60 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_attention_gpu.py -k "batch_1 or planner_picks" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el decode
timeout 80 python3 -m jax_onnx_attn.bench decode --dtypes fp16 bf16 --heads 32/8 --dims 128 --batch 1 \
  --ctx 4096 8192 16384 --qlen 1 --impls ours jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 75 --out "$out/dec.json" 2>&1 | grep -v Warning | tail -9
el done
} 2>&1 | tee "$out/run.log"
