#!/usr/bin/env bash
# Session 27, call C (~7 min): the "wave" plan policy as the default. 1) GPU tests: the decode engine
# file but its shape sweep (the capped policies at B=2-16, ragged lengths, bitwise), the vmap test;
# 2) the decode grid at the e2e bench's capacities (1280 / 2304 rows: ctx 1k / 2k + 144) where
# "wave" differs from "ladder", and B=1 (unchanged plans) as the control; 3) ~1B decoders at B=4 / 8
# ctx 1k (capacity 1280: 5- / 3-CTA clusters instead of 7 / 4), ours (wave) beside ours[ladder]
# and the JAX peer; 4) B=1 split / cluster plans at five shapes (tools/sweep_splits.py, printed).
# To $OUT: prepare.log, tests.log, dec.json, e2e_fp16.json, e2e_int4.json, run.log (the sweeps in run.log).
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 200 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_attention_gpu.py tests/gpu/test_spmd_gpu.py -k "not test_shapes and (vmap or not spmd)" \
  > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -8
el decode
timeout 100 python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 1 2 4 8 \
  --ctx 1280 2304 --qlen 1 --impls ours ours[ladder] jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 90 --out "$out/dec.json" 2>&1 | grep -v Warning | tail -18
el sweep  # B=1: which split / cluster plan is fastest at the e2e capacities (and issue 15's 4k / 8k)
for shape in "128 2304" "128 4096" "128 8448" "64 1280" "64 2304"; do
  set -- $shape
  timeout 60 python3 tools/sweep_splits.py --batch 1 --ctx $2 --dim $1 --dtype fp16 --split-rows 64 128 256 \
    --cluster --cluster-splits 4 6 8 12 16 --out "/tmp/sweep_d$1_c$2.json" 2>&1 | grep -v Warning | grep " us "
done
for w in fp16 int4; do
  el e2e $w
  timeout 110 python3 -m jax_onnx_attn.bench e2e --phases decode --models 1b --weights $w --batch 4 8 \
    --ctx 1024 --impls ours jax-peer --ours-env ladder:JOA_DECODE_PLAN=ladder --profile none \
    --max-seconds 100 --models-dir /tmp/models --out "$out/e2e_$w.json" 2>&1 |
    grep -v Warning | grep -E "decode  |verify|Error"
done
el done
} 2>&1 | tee "$out/run.log"
