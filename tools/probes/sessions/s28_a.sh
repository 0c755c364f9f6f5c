#!/usr/bin/env bash
# Session 28, call A (~6 min): 1) how many clusters of each size one wave of the H200 holds at 1-3
# CTAs an SM (tools/probes/cluster_occupancy: the numbers for plan.h's wave cap); 2) the GPU tests
# of session 27's last planner edits (B=1 d128 plans, the d64 cluster test, the capped policies);
# 3) B=1 plans at the shapes not swept yet (d128 1280 and 16k, bf16 4k); 4) ~8B fp16 B=1 ctx 2k
# whole with the B=1 rule (ours) beside ours[ladder] and the JAX peer.
# To $OUT: prepare.log, occupancy.json, tests.log, e2e_8b.json, run.log (sweeps in run.log).
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el occupancy
nvcc -arch=sm_90a -o /tmp/cluster_probe tools/probes/cluster_occupancy/probe.cu && /tmp/cluster_probe | tee "$out/occupancy.json"
el tests
timeout 120 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_attention_gpu.py -k "batch_1 or planner_picks or capped" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el sweep
for shape in "fp16 1280 64 128 256" "fp16 16384 256 512 1024" "bf16 4096 128 256 512"; do
  set -- $shape
  timeout 60 python3 tools/sweep_splits.py --batch 1 --ctx $2 --dim 128 --dtype $1 --split-rows $3 $4 $5 \
    --cluster --cluster-splits 4 8 16 --out "/tmp/sweep_$1_$2.json" 2>&1 | grep -v Warning | grep " us "
done
el e2e
timeout 170 python3 -m jax_onnx_attn.bench e2e --phases decode --models 8b --weights fp16 --batch 1 \
  --ctx 2048 --impls ours jax-peer --ours-env ladder:JOA_DECODE_PLAN=ladder --profile none --no-verify \
  --max-seconds 160 --models-dir /tmp/models --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | grep -E "decode  |Error"
el done
} 2>&1 | tee "$out/run.log"
