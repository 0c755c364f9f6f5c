#!/usr/bin/env bash
# Session 28, call C (~6 min): 1) the decode engine's GPU tests but the shape sweep (the measured
# wave table's plans at B=2-16 among them) and the vmap test; 2) issue 15's B=1 / B=8 decode rows,
# ours beside cuDNN in one run; 3) ~1B int4 B=4 / 8 ctx 1k whole (session 27's B=4 loss under the
# worst-case cap), ours beside ours[ladder] and the JAX peer.
# To $OUT: prepare.log, tests.log, dec.json, e2e_int4.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el decode
timeout 80 python3 -m jax_onnx_attn.bench decode --dtypes fp16 bf16 --heads 32/8 --dims 128 --batch 1 8 \
  --ctx 4096 8192 16384 --qlen 1 --impls ours jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 75 --out "$out/dec.json" 2>&1 | grep -v Warning | tail -14
el e2e int4
timeout 130 python3 -m jax_onnx_attn.bench e2e --phases decode --models 1b --weights int4 --batch 4 8 \
  --ctx 1024 --impls ours jax-peer --ours-env ladder:JOA_DECODE_PLAN=ladder --profile none --no-verify \
  --max-seconds 120 --models-dir /tmp/models --out "$out/e2e_int4.json" 2>&1 | grep -v Warning | grep -E "decode  |Error"
el tests
timeout 230 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_attention_gpu.py tests/gpu/test_spmd_gpu.py -k "not test_shapes and (vmap or not spmd)" \
  > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el done
} 2>&1 | tee "$out/run.log"
