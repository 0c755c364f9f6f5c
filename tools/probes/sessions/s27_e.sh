#!/usr/bin/env bash
# Session 27, call E (what fits ~2 min): call D's first two parts, the bench first. B=1 d128 decode,
# ours (wave) / ours[long] / cuDNN; then the GPU test of the long plans. To $OUT: prepare.log,
# dec.json, tests.log, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el decode
timeout 50 python3 -m jax_onnx_attn.bench decode --dtypes fp16 bf16 --heads 32/8 --dims 128 --batch 1 \
  --ctx 2304 4096 8192 --qlen 1 --impls ours ours[long] jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 45 --out "$out/dec.json" 2>&1 | grep -v Warning | tail -8
el tests
timeout 45 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_attention_gpu.py -k "long_plan" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el done
} 2>&1 | tee "$out/run.log"
