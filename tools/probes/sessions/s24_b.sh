#!/usr/bin/env bash
# Session 24, second call (~8 min): the rows kernel with its block metadata copied once per g
# (branch rows-meta-shared: 1280-byte ring stages instead of 1792): GPU tests, then every depth-2
# layout's device time on the ~8B (with 2-warp CTAs) and ~1B projections at M 8 / 32, then the ~8B
# int4 decoder at B=8 / 32 ctx 2k beside the JAX peer (the planner unchanged).
# To $OUT: prepare.log, tests.log, rows_8b.json, rows_1b.json, e2e_8b.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 110 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_linear_rows_gpu.py \
  tests/gpu/test_linear_gpu.py::test_every_output_element_is_written > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -2 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
export XLA_PYTHON_CLIENT_PREALLOCATE=false
el rows8b
timeout 170 python3 tools/probes/rows_kernel_times.py "$out/rows_8b.json" 8b d2 w2 2>&1 | cut -c1-300 | tail -2
el rows1b
timeout 120 python3 tools/probes/rows_kernel_times.py "$out/rows_1b.json" d2 2>&1 | cut -c1-300 | tail -2
unset XLA_PYTHON_CLIENT_PREALLOCATE
el e2e
timeout 150 python3 -m jax_onnx_attn.bench e2e --models 8b --weights int4 --batch 8 32 --ctx 2048 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 140 --models-dir /tmp/models \
  --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | grep "decode\|total"
el done
} 2>&1 | tee "$out/run.log"
