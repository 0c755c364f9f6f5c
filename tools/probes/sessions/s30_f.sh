#!/usr/bin/env bash
# Session 30, call F (~3 min): the route between the quantised tile kernel and the register kernel
# (plan.h kQuantRegsMinRows = 131072 KV rows a call) now that the register kernel's key-rows form is
# the default: ours[tiles] vs ours[key-rows] (both forced) at 32k-128k rows (B=1 8k, B=2 4k / 8k,
# B=4 2k / 4k), bf16 32/8 d128 int8 / int4.
# To $OUT: prepare.log, route.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
{
timeout 150 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 1 2 4 \
  --ctx 2048 4096 8192 --qlen 1 --kv-bits 8 4 --impls ours[tiles] ours[key-rows] --target-ms 10 --reps 3 \
  --max-seconds 140 --out "$out/route.json" 2>&1 | grep -v Warning | tail -22
} 2>&1 | tee "$out/run.log"
