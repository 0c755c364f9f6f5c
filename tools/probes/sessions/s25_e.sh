#!/usr/bin/env bash
# Session 25, fifth call (~3 min): the ~1B fp16 B=8 ctx 2k step profiled inside XLA's command buffers
# (where ours idles ~77 us a step more than the peer between kernels), ours and the JAX peer, the
# traces kept for the gaps by kernel pair. To $OUT: prepare.log, profile_cb.json, trace-*.json.gz, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
{
timeout 200 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 --batch 8 --ctx 2048 --phases decode \
  --impls ours jax-peer --profile all --profile-command-buffers --no-verify --max-seconds 180 \
  --models-dir /tmp/models --trace-dir "$out" --out "$out/profile_cb.json" 2>&1 | grep -v Warning | tail -4
ls -la "$out"
} 2>&1 | tee "$out/run.log"
