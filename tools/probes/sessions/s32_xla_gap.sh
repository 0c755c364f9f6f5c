#!/usr/bin/env bash
# Session 32, call A (prepared in session 31): is the decode engine's XLA-vs-raw-graph gap
# (bench/results/2026-12-01-e2e-notes.md, "Session 31") where jax places the buffers? (It was not:
# "Session 32".) Here: nvcc ... tools/probes/decode_raw_on_jax.cu -o decode_raw_on_jax.so (its
# header says how), xz it into .snap/ (the carry limit), then carry .snap. There (~2.5 min): the
# probe under jax's default allocator, XLA_PYTHON_CLIENT_ALLOCATOR=platform and
# XLA_PYTHON_CLIENT_PREALLOCATE=false; bench decode B=1 and two fp16 GEMVs under the same three.
# Its XLA figures ran without command buffers (the probe's helper import; fixed since: probe_results.py).
# To $OUT: prepare.log, raw_on_jax_*.json, run.log.
set -uo pipefail
lib=/tmp/decode_raw_on_jax.so
xz -d -c .snap/decode_raw_on_jax.so.xz > $lib
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
for env in "" "XLA_PYTHON_CLIENT_ALLOCATOR=platform" "XLA_PYTHON_CLIENT_PREALLOCATE=false"; do
  el "env: ${env:-default}"
  name=$(echo "${env:-default}" | tr -dc 'a-z' | head -c 20)
  (cd tools/probes && env $env timeout 100 python3 decode_raw_on_jax.py "$lib" "$out/raw_on_jax_$name.json") 2>&1 | \
    grep -v Warn | tail -4
  env $env timeout 60 python3 -m jax_onnx_attn.bench decode --batch 1 --ctx 2304 4096 8192 --qlen 1 --heads 32/8 \
    --dims 128 --dtypes bf16 --impls ours --target-ms 10 --reps 5 --max-seconds 50 2>&1 | grep -E "^B=1" | tail -3
  env $env timeout 40 python3 -m jax_onnx_attn.bench linear --rows 1 --formats fp16 --impls ours xla-nk \
    --shapes 4096x28672 4096x4096 --max-seconds 30 2>&1 | grep -v Warn | tail -6
done
el done
} 2>&1 | tee "$out/run.log"
