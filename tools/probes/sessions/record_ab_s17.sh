#!/usr/bin/env bash
# Session 17, one device call (~9 min): the int4 record layout (helper series, JOA_GEMV_RECORD) —
# its GPU tests and the slots kernel's (the kernel became a policy of its weight source), the
# GEMV A/B on the ~1B / ~8B shapes (bench linear --nbits-record), the whole-step A/B at B=1 (ours /
# ours[rec] / JAX peer, prompt and decode, int4 ~8B and ~1B); then the decode split sweep at B=1
# d128 (the planner's cluster plan against more splits), then ~8B fp16 prompts on the new d128
# prefill default (TTFT vs the JAX peer). Outputs straight to $OUT (a timeout keeps what finished).
# To $OUT: prepare.log, tests.log, linear_record.json, e2e_record.json, e2e_record.txt,
# split_sweep.txt, e2e_prefill_8b.json, e2e_prefill_8b.txt.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PT="python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider"
el "gpu tests"
{
  timeout 140 $PT tests/gpu/test_linear_record_gpu.py tests/gpu/test_linear_gpu.py \
    -k "record or slots or nbits_fusions or repeatable or written or command_buffer or auto_backend" 2>&1 | tail -12
} > "$out/tests.log" 2>&1
grep -E "passed|failed|FAILED|rror" "$out/tests.log" | tail -8
el "linear A/B"
timeout 60 python3 -m jax_onnx_attn.bench linear --rows 1 --formats int4 --impls ours --nbits-record \
  --block 32 --out "$out/linear_record.json" 2>&1 | grep -v Warning | tail -14
el "e2e int4 B=1 A/B"
timeout 200 python3 -m jax_onnx_attn.bench e2e --models 8b 1b --weights int4 --batch 1 --ctx 2048 \
  --phases prefill decode --impls ours jax-peer --ours-env rec:JOA_GEMV_RECORD=1 --profile first \
  --models-dir /tmp/models --max-seconds 180 --out "$out/e2e_record.json" 2>&1 | grep -v Warning \
  | tail -14 | tee "$out/e2e_record.txt"
el "split sweep"
{
  timeout 30 python3 tools/sweep_splits.py --batch 1 --ctx 8192 --dim 128 --dtype fp16 \
    --split-rows 128 256 512 --cluster-splits 8 16 2>&1 | grep -v Warning
  timeout 25 python3 tools/sweep_splits.py --batch 1 --ctx 2048 --dim 128 --dtype fp16 \
    --split-rows 64 128 256 --cluster-splits 8 16 2>&1 | grep -v Warning
} | tee "$out/split_sweep.txt"
el "8B fp16 prompts"
timeout 130 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 --batch 1 --ctx 2048 8192 \
  --phases prefill --impls ours jax-peer --models-dir /tmp/models --profile none --no-verify \
  --max-prefill-tokens 8192 --max-seconds 120 --out "$out/e2e_prefill_8b.json" 2>&1 | grep -v Warning \
  | tail -8 | tee "$out/e2e_prefill_8b.txt"
el done
