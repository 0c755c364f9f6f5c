#!/usr/bin/env bash
# Session 22, the landing call (~9 min): the rows kernel's pushed reduction and the slots kernel's
# record ring (merged from slots-record-ring). 1) GPU tests: the rows file, the record file (every
# ring vs ring 0 bit for bit, vs the reference), every output written; 2) the ~1B (ctx 1k) and ~8B
# (ctx 2k) int4 decoders' decode step at B 1 / 8 / 32 beside the JAX peer; 3) the record paths'
# device time per call (ring 0 / planned / 2-4); 4) the rows phase probe at M 8 / 32.
# To $OUT: prepare.log, tests.log, e2e_1b.json, e2e_8b.json, record.json, rows_probe.txt, run.log.
set -uo pipefail
BIN=$PWD/build/gemv_int4_rows
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 150 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_linear_rows_gpu.py \
  tests/gpu/test_linear_record_gpu.py tests/gpu/test_linear_gpu.py::test_every_output_element_is_written > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -2 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el e2e
timeout 100 python3 -m jax_onnx_attn.bench e2e --models 1b --weights int4 --batch 1 8 32 --ctx 1024 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 90 --models-dir /tmp/models \
  --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | grep "decode\|total"
timeout 200 python3 -m jax_onnx_attn.bench e2e --models 8b --weights int4 --batch 1 8 32 --ctx 2048 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 190 --models-dir /tmp/models \
  --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | grep "decode\|total"
el record
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 python3 tools/probes/record_kernel_times.py "$out/record.json" noxla 2>&1 | tail -14
el probe
for m in 8 32; do
  JOA_PROBE_8B=1 JOA_PROBE_BS=32 JOA_PROBE_M=$m timeout 30 "$BIN" >> "$out/rows_probe.txt" 2>&1
  echo "rc $?" >> "$out/rows_probe.txt"
done
grep -v timeline "$out/rows_probe.txt" | cut -c1-34,100-175
el done
} 2>&1 | tee "$out/run.log"
