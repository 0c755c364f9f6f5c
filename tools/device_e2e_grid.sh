#!/usr/bin/env bash
# Run on the GPU machine (carry .snap from tools/snapshot.sh --so ...): issue 12's whole-model grid in
# one call (~9 min): the ~8B decoder (fp16, int4; B 1 / 8; ctx 2k / 8k; decode and the B=1 prompt)
# and the ~1B (fp16, int4; B 1 / 32; ctx 1k / 16k), ours and the JAX peer in the same process, the
# first case of each group profiled (kernels a step, busy / idle time). Each run has its own
# --max-seconds; cases that do not fit are listed under "skipped" in its JSON.
# To $OUT: prepare.log, e2e_8b.json, e2e_1b.json, e2e_grid.txt (the printed tables).
set -uo pipefail
source "$(dirname "$0")/device_prepare.sh"
common="--impls ours jax-peer --phases prefill decode --profile first --models-dir /tmp/models"
{
  timeout 330 python3 -m jax_onnx_attn.bench e2e --models 8b --weights fp16 int4 --batch 1 8 \
    --ctx 2048 8192 --max-prefill-tokens 8192 --max-seconds ${E2E_8B_S:-280} $common \
    --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -40
  timeout 230 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 int4 --batch 1 32 \
    --ctx 1024 16384 --max-prefill-tokens 4096 --max-seconds ${E2E_1B_S:-190} $common \
    --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -40
} | tee "$out/e2e_grid.txt"
