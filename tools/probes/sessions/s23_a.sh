#!/usr/bin/env bash
# Session 23, first call (~9 min): the record ring removed and the rows partial-sum layout from one
# definition (55491d0). 1) GPU tests: the rows file, the record file, every output written; 2) the
# ~1B (ctx 1k) and ~8B (ctx 2k) int4 decoders' B=1 step beside the JAX peer (the register path
# again); 3) the rows kernel's device time per call at M 8 / 32 over clusters 1-16 x 4 / 8 warps
# at depth 2 (the planner's re-fit after the pushed reduction), ~1B and ~8B shapes.
# To $OUT: prepare.log, tests.log, e2e_1b.json, e2e_8b.json, rows_1b.json, rows_8b.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 160 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_linear_rows_gpu.py \
  tests/gpu/test_linear_record_gpu.py tests/gpu/test_linear_gpu.py::test_every_output_element_is_written > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -2 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el e2e
timeout 70 python3 -m jax_onnx_attn.bench e2e --models 1b --weights int4 --batch 1 --ctx 1024 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 60 --models-dir /tmp/models \
  --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | grep "decode\|total"
timeout 120 python3 -m jax_onnx_attn.bench e2e --models 8b --weights int4 --batch 1 --ctx 2048 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 110 --models-dir /tmp/models \
  --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | grep "decode\|total"
el rows
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 130 python3 tools/probes/rows_kernel_times.py "$out/rows_1b.json" d2 2>&1 | cut -c1-400 | tail -3
el rows8b
timeout 150 python3 tools/probes/rows_kernel_times.py "$out/rows_8b.json" 8b d2 2>&1 | cut -c1-400 | tail -3
el done
} 2>&1 | tee "$out/run.log"
