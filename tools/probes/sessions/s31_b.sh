#!/usr/bin/env bash
# Ran at 5a15ab4 (the speculated tiles since reverted: tools/patches/decode-speculate/ for ours[spec]).
# Session 31, call B (~3 min): where a B=1 decode call's time goes and whether the speculated first
# tiles (JOA_DECODE_SPECULATE) move it. 1) tools/probes/decode_b1_timeline.py: 32 chained calls in a
# command buffer, profiled (split / combine kernel durations, the start-to-start period), bf16 32/8
# d128 at 2304 / 4096 / 8192 rows, speculation off and on; 2) bench decode B=1, ours / ours[spec] /
# ours[no-spec] / jax-cudnn, 7 reps (call A's 3 left a 3-5% spread). To $OUT: prepare.log,
# timeline.json, dec.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el timeline
(cd tools/probes && timeout 120 python3 decode_b1_timeline.py "$out/timeline.json") 2>&1 | grep -v Warning | tail -8
el decode
timeout 150 python3 -m jax_onnx_attn.bench decode --batch 1 --ctx 2304 4096 8192 --qlen 1 --heads 32/8 \
  --dims 128 --dtypes bf16 fp16 --impls ours ours[spec] ours[no-spec] jax-cudnn --target-ms 10 --reps 7 \
  --max-seconds 140 --out "$out/dec.json" 2>&1 | grep -v Warning | tail -12
el done
} 2>&1 | tee "$out/run.log"
