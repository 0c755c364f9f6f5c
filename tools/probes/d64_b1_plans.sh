#!/usr/bin/env bash
# Prepared in session 40 (not yet run): the ~1B decoder's attention shape (fp16, 32 / 8 heads, head
# dim 64, B=1) on every decode form the engine has, against cuDNN, at the contexts issue 12 names.
# Why: in the ~1B e2e step (H100, session 40) our split kernel took 6.74 us a call at 1k where the
# JAX peer's cuDNN SDPA kernel took 5.03 (16 calls a step: ~27 us of a 1.13 ms step), and issue 15's
# targets (and the planner's measurements) were at head dim 128. The forms are env switches the
# session already reads, so a winner becomes a default (or a d64 rule in plan.h) without new kernels.
# Here: bash tools/snapshot.sh --so <the device .so>; carry .snap. ~3-4 min on a warm machine.
# To $OUT: prepare.log, d64_forms.json, d64_splits_1k.json, d64_splits_4k.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el "forms (bench decode, device time)"
# From /tmp, so that no folder shadows the package on sys.path.
(cd /tmp && PYTHONPATH=/tmp/joa timeout 200 python3 -m jax_onnx_attn.bench decode --batch 1 \
  --ctx 1024 2048 4096 8192 --qlen 1 --heads 32/8 --dims 64 --dtypes fp16 --target-ms 10 --reps 5 \
  --impls ours "ours[cursor]" "ours[tile128]" "ours[tile128+cursor]" "ours[producer]" "ours[fit]" \
          "ours[ladder]" "ours[prefill-engine]" jax-cudnn --device-time --max-seconds 180 \
  --out "$out/d64_forms.json" 2>&1 | grep -E "^B=" | tail -40)
for ctx in 1024 4096; do
  el "split sizes at $ctx (tools/sweep_splits.py; the cluster plans of 4-16 splits too)"
  (cd /tmp && PYTHONPATH=/tmp/joa timeout 90 python3 /tmp/joa/tools/sweep_splits.py --batch 1 --ctx $ctx \
    --heads 32/8 --dim 64 --dtype fp16 --split-rows 64 128 256 512 --cluster --cluster-splits 4 8 16 \
    --out "$out/d64_splits_$((ctx / 1024))k.json" 2>&1 | tail -12)
done
el done
} 2>&1 | tee "$out/run.log"
