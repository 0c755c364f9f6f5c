#!/usr/bin/env bash
# Session 22, the rows kernel's pushed split-K reduction (~6 min): 1) the rows GPU test file; 2) the
# phase probe (build/gemv_int4_rows, carried) at M 8 / 32; 3) the ~1B (ctx 1k) and ~8B (ctx 2k) int4
# decoders' decode step at B 8 / 32 beside the JAX peer. To $OUT: prepare.log, tests.log,
# rows_probe.txt, e2e_1b.json, e2e_8b.json, run.log.
set -uo pipefail
BIN=$PWD/build/gemv_int4_rows
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 120 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_linear_rows_gpu.py \
  > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -2 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el probe
for m in 8 32; do
  JOA_PROBE_8B=1 JOA_PROBE_BS=32 JOA_PROBE_M=$m timeout 80 "$BIN" >> "$out/rows_probe.txt" 2>&1
  echo "rc $?" >> "$out/rows_probe.txt"
done
grep -v timeline "$out/rows_probe.txt" | cut -c1-34,100-175
el e2e
timeout 110 python3 -m jax_onnx_attn.bench e2e --models 1b --weights int4 --batch 8 32 --ctx 1024 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 100 --models-dir /tmp/models \
  --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -6
timeout 220 python3 -m jax_onnx_attn.bench e2e --models 8b --weights int4 --batch 8 32 --ctx 2048 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 200 --models-dir /tmp/models \
  --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -6
el done
} 2>&1 | tee "$out/run.log"
