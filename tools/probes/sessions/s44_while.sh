#!/usr/bin/env bash
# Session 44 (~2 min): the decode step with XLA's WHILE / CONDITIONAL command buffers
# ($JOA_XLA_COMMAND_BUFFER=while: the session's loops captured whole, their predicates read on the
# device) against XLA's default kinds, ~1B fp16 / int4, B=1, ctx 1k, two rounds, one process.
# The last such A/B (2026-11-30, the first session's step and loop) had WHILE slower.
# To $OUT: prepare.log, e2e_1b_while.json.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
timeout 130 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 int4 --batch 1 --ctx 1024 \
  --phases decode --impls ours --ours-env while:JOA_XLA_COMMAND_BUFFER=while --rounds 2 --profile none \
  --models-dir /tmp/models --max-seconds 100 --out "$out/e2e_1b_while.json" 2>&1 | grep -v Warning | tail -14
