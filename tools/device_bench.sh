#!/usr/bin/env bash
# Run on the GPU machine: the decode benchmark grid that bench/results/ records, on the carried
# snapshot (tools/snapshot.sh). Usage: bash tools/device_bench.sh [max seconds per part]; JSON to $OUT.
set -uo pipefail
source "$(dirname "$0")/device_prepare.sh"
cap=${1:-150}
B="python3 -m jax_onnx_attn.bench decode --reps 5 --impls ours jax-xla jax-cudnn torch-cudnn"
# The headline configuration (bf16, GQA 32/8, d128) over the issue's batch x context x q_len grid.
$B --dtypes bf16 --heads 32/8 --dims 128 --batch 1 8 32 128 --ctx 1024 4096 16384 131072 --qlen 1 4 16 \
  --max-seconds "$cap" --out "$out/headline.json" 2>&1 | tee "$out/headline.txt" | grep -v "us/"
# The other configurations the issue names, at a decode batch and a long-context batch.
$B --dtypes bf16 fp16 --heads 32/8 64/8 --dims 128 256 --batch 1 8 --ctx 4096 16384 --qlen 1 16 \
  --max-seconds "$cap" --out "$out/configs.json" 2>&1 | tee "$out/configs.txt" | grep -v "us/"
