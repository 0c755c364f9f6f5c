#!/usr/bin/env bash
# Session 25, first call (~9 min): the dense rows kernel (dense_rows.cuh, 2..32 rows of dense half
# weights): its GPU tests with the dense linear tests it now serves, its device time per call beside
# the ring kernel and XLA's dot on the ~1B / ~8B shapes, then the ~1B fp16 decoder at B=8 / 32
# (ctx 2k) with it (ours), without it (ours[xla]: JOA_GEMV_DENSE_ROWS=0) and the JAX peer.
# To $OUT: prepare.log, tests.log, times.json, e2e_1b.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 170 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_linear_gpu.py \
  -k "dense or every_output or command_buffer or loop" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -2 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el times
timeout 150 python3 tools/probes/dense_rows_times.py "$out/times.json" 2>&1 | grep -v Warning | tail -32
el e2e
timeout 170 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 --batch 8 32 --ctx 2048 \
  --phases decode --impls ours jax-peer --ours-env xla:JOA_GEMV_DENSE_ROWS=0 --profile none --max-seconds 160 \
  --models-dir /tmp/models --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | grep -E "decode  |token|verif" | head -12
el done
} 2>&1 | tee "$out/run.log"
