#!/usr/bin/env bash
# Session 22's last call (~2 min): the record ring planned off (kRecordRingPlanned 0): the ~1B int4
# decoder at B=1, ctx 1k, beside the JAX peer. To $OUT: prepare.log, e2e.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
{
timeout 100 python3 -m jax_onnx_attn.bench e2e --models 1b --weights int4 --batch 1 --ctx 1024 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 90 --models-dir /tmp/models \
  --out "$out/e2e.json" 2>&1 | grep -v Warning | grep "decode\|total"
} 2>&1 | tee "$out/run.log"
