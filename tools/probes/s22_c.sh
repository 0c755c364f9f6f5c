#!/usr/bin/env bash
# Session 22, the rows kernel's phases (~6 min): 1) tools/probes/gemv_int4_rows.cu (carried prebuilt as
# build/gemv_int4_rows) at M 8 / 32, block 32, ~1B and ~8B shapes: per call in a graph chain beside a
# W-only stream, and one launch's timeline (JOA_GEMV_MARK); 2) the ~8B int4 decoder's decode step at
# B 1 / 8 / 32, ctx 2k, beside the JAX peer. To $OUT: prepare.log, rows_probe.txt, e2e.json, run.log.
set -uo pipefail
BIN=$PWD/build/gemv_int4_rows
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el probe
for m in 8 32; do
  JOA_PROBE_8B=1 JOA_PROBE_BS=32 JOA_PROBE_M=$m timeout 80 "$BIN" >> "$out/rows_probe.txt" 2>&1
  echo "rc $?" >> "$out/rows_probe.txt"
done
grep -v timeline "$out/rows_probe.txt" | cut -c1-200
el e2e
timeout 300 python3 -m jax_onnx_attn.bench e2e --models 8b --weights int4 --batch 1 8 32 --ctx 2048 \
  --phases decode --impls ours jax-peer --profile none --max-seconds 280 --models-dir /tmp/models \
  --out "$out/e2e.json" 2>&1 | grep -v Warning | tail -8
el done
} 2>&1 | tee "$out/run.log"
