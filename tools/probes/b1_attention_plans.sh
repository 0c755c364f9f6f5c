#!/usr/bin/env bash
# A decoder's batch-1 attention shape (fp16, 32 / 8 heads, head dim DIM, B=1) on every decode form
# the engine has, against cuDNN, at the contexts issue 12 names, then the split / cluster plans.
# Why: in the e2e step our split kernel takes more than cuDNN's at short contexts. ~1B (DIM=64, the
# default; H100, session 40): 6.74 us a call at 1k against the JAX peer's cuDNN SDPA 5.03 (16 calls a
# step). ~8B (DIM=128 SPLIT_CTXS="2048 8192"; H100, session 42): split + combine 13.9 us a layer at
# 2k for 8.4 MB of KV (2.5 us at the H100's peak): 364 us of a 5.71 ms fp16 step and of a 2.40 ms
# int4 one over its bytes. Issue 15's targets and the planner's measurements were at head dim 128
# with a rotated (L2-cold) cache, as here. The forms are env switches the session already reads,
# so a winner becomes a default (or a rule in plan.h) without new kernels.
# Here: bash tools/snapshot.sh --so <the device .so>; carry .snap. ~3-4 min on a warm machine.
# To $OUT: prepare.log, d${DIM}_forms.json, d${DIM}_splits_<ctx>k.json (one a SPLIT_CTXS), run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
dim=${DIM:-64}
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el "forms at d$dim (bench decode, device time)"
# From /tmp, so that no folder shadows the package on sys.path.
(cd /tmp && PYTHONPATH=/tmp/joa timeout 200 python3 -m jax_onnx_attn.bench decode --batch 1 \
  --ctx 1024 2048 4096 8192 --qlen 1 --heads 32/8 --dims $dim --dtypes fp16 --target-ms 10 --reps 5 \
  --impls ours "ours[cursor]" "ours[tile128]" "ours[tile128+cursor]" "ours[producer]" "ours[fit]" \
          "ours[ladder]" "ours[prefill-engine]" jax-cudnn --device-time --max-seconds 180 \
  --out "$out/d${dim}_forms.json" 2>&1 | grep -E "^B=" | tail -40)
for ctx in ${SPLIT_CTXS:-1024 4096}; do
  el "split sizes at $ctx (tools/sweep_splits.py; the cluster plans of 4-16 splits too)"
  (cd /tmp && PYTHONPATH=/tmp/joa timeout 90 python3 /tmp/joa/tools/sweep_splits.py --batch 1 --ctx $ctx \
    --heads 32/8 --dim $dim --dtype fp16 --split-rows 64 128 256 512 --cluster --cluster-splits 4 8 16 \
    --out "$out/d${dim}_splits_$((ctx / 1024))k.json" 2>&1 | tail -12)
done
el done
} 2>&1 | tee "$out/run.log"
