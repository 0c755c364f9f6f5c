#!/usr/bin/env bash
# Run on the GPU machine: the decode benchmark grid that bench/results/ records, on the carried
# snapshot (tools/snapshot.sh). Usage: bash tools/device_bench.sh; JSON and tables to $OUT.
# About 3.5 minutes of device time: B=1 over context and q_len, the >= 1 GB batches, then the other
# configurations (d256, 64/8, fp16, jax-xla) for what is left of a 40 s budget.
set -uo pipefail
source "$(dirname "$0")/device_prepare.sh"
B="python3 -m jax_onnx_attn.bench decode --reps 5"
H="--dtypes bf16 --heads 32/8 --dims 128"
$B $H --impls ours jax-cudnn torch-cudnn --batch 1 --ctx 1024 4096 8192 16384 131072 --qlen 1 4 16 \
  --max-seconds 50 --out "$out/b1.json" 2>&1 | grep -v "us/" | tail -20
$B $H --impls ours jax-cudnn torch-cudnn --batch 8 32 --ctx 16384 131072 --qlen 1 4 16 \
  --max-seconds 80 --out "$out/big.json" 2>&1 | grep -v "us/" | tail -16
$B --impls ours jax-xla jax-cudnn torch-cudnn --dtypes bf16 fp16 --heads 64/8 32/8 --dims 256 128 \
  --batch 128 8 --ctx 4096 --qlen 1 16 --max-seconds 40 --out "$out/configs.json" 2>&1 \
  | grep -v "us/" | tail -20
