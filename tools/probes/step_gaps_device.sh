#!/usr/bin/env bash
# Session 36's follow-up for issue 12: where a ~1B B=1 step still loses time at HEAD (the rows
# taken out, the decode loop in check blocks). On the H200 at 6384ffc a ~1B fp16 B=1 step was 955 µs
# against 910 of kernels (profiled, 92 kernels): o + down 8.35 µs a call at 2.51 TB/s, the fused QKV
# 6.7 at 1.87, attention 6.1 for 2 MB of KV; gate-up 3.54 TB/s, LM head 4.37.
# Here: commit; bash tools/snapshot.sh --so <the .so of the same C++>; carry .snap.
#   bash tools/probes/step_gaps_device.sh grid     # e2e ~1B fp16 / int4 B=1 / 8 1k, ours vs the JAX peer (baseline at HEAD)
#   bash tools/probes/step_gaps_device.sh 8b       # e2e ~8B fp16 B=1 / 8 2k
#   bash tools/probes/step_gaps_device.sh cmdbuf   # ~1B fp16 B=1 traced with the command buffers kept
#                                                  # (--profile-command-buffers): kernel gaps as they run untraced
#   bash tools/probes/step_gaps_device.sh linear   # bench linear fp16 M=1, the ~1B shapes one by one, ours vs XLA
# To $OUT: prepare.log, e2e_*.json, linear.json, run_*.log (at most 8 files: pick phases).
set -uo pipefail
phases=${*:-grid}
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
E2E="python3 -m jax_onnx_attn.bench e2e --phases decode --reps 3 --models-dir /tmp/models"
for phase in $phases; do
{
case "$phase" in
  grid)
    el "e2e ~1B 1k"
    timeout 300 $E2E --models 1b --weights fp16 int4 --ctx 1024 --batch 1 8 --impls ours jax-peer --profile all \
      --max-seconds 280 --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -12
    python3 -m jax_onnx_attn.bench breakdown "$out/e2e_1b.json" 2>&1 | tail -44 ;;
  8b)
    el "e2e ~8B 2k"
    timeout 330 $E2E --models 8b --weights fp16 --ctx 2048 --batch 1 8 --impls ours jax-peer --profile all \
      --max-seconds 310 --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -8
    python3 -m jax_onnx_attn.bench breakdown "$out/e2e_8b.json" 2>&1 | tail -22 ;;
  cmdbuf)
    el "e2e ~1B fp16 B=1, profiled with command buffers"
    timeout 200 $E2E --models 1b --weights fp16 --ctx 1024 --batch 1 --impls ours jax-peer --profile all \
      --profile-command-buffers --max-seconds 180 --out "$out/e2e_1b_cmdbuf.json" 2>&1 | grep -v Warning | tail -6
    for i in ours jax-peer; do python3 -m jax_onnx_attn.bench breakdown --impl $i "$out/e2e_1b_cmdbuf.json" 2>&1 | tail -11; done ;;
  linear)
    el "bench linear fp16 M=1, ~1B shapes"
    timeout 200 python3 -m jax_onnx_attn.bench linear --formats fp16 --rows 1 \
      --shapes 2048x2048 8192x2048 2048x3072 2048x16384 --impls ours xla-nk \
      --max-seconds 180 --out "$out/linear.json" 2>&1 | tail -16 ;;
esac
el done
} 2>&1 | tee "$out/run_$phase.log"
done
