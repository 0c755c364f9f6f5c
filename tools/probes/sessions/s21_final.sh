#!/usr/bin/env bash
# Session 21's last call (~5 min), at the landed commit: the rows kernel with its W ring and the
# planner fitted to its sweep. 1) its GPU test file (values vs the reference, forced plans,
# occupancy 2, bits, command buffers); 2) the ~1B int4 decoder's decode step at B 1 / 8 / 32, ctx 1k,
# beside the JAX peer; 3) the planned layouts' device time per call at the ~1B shapes.
# To $OUT: prepare.log, tests.log, e2e.json, times.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 150 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_linear_rows_gpu.py \
  > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -2 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el e2e
timeout 170 python3 -m jax_onnx_attn.bench e2e --models 1b --weights int4 --batch 1 8 32 --ctx 1024 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 150 --models-dir /tmp/models \
  --out "$out/e2e.json" 2>&1 | grep -v Warning | tail -8
el times
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 tools/probes/rows_kernel_times.py "$out/times.json" planned 2>&1 | cut -c1-200 | tail -12
el done
} 2>&1 | tee "$out/run.log"
