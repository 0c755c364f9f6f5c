#!/usr/bin/env bash
# Session 17, one device call (~7 min): GPU tests of what changed (the L2 prefetch target, the 128-row
# tile's command-buffer test, the prefill engine with pingpong-fold-lazy as the d128 default and the
# prompt routes on it), then the whole-step A/B of the L2 prefetch before each decode attention
# (JOA_L2_PREFETCH_MB / _MODE as --ours-env variants of ours, the JAX peer as the anchor), fp16 ~8B
# and ~1B at B=1, ctx 2k / 8k, first case of each group profiled.
# Build and carry the snapshot first (tools/build_device_ext.sh; tools/snapshot.sh --so <.so>;
# carry ".snap"), then from the repo root: bash .snap/tools/probes/l2_prefetch_ab.sh
# To $OUT: prepare.log, tests.log, e2e_prefetch.json, e2e_prefetch.txt.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PT="python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider"
el "gpu tests"
{
  timeout 100 $PT tests/gpu/test_l2_prefetch_gpu.py tests/gpu/test_prefill_engine_gpu.py 2>&1 | tail -8
  timeout 60 $PT tests/gpu/test_decode_tile128_gpu.py -k command_buffer 2>&1 | tail -3
  timeout 90 $PT tests/gpu/test_prefill_route_gpu.py tests/gpu/test_attention_prefill_route_gpu.py 2>&1 | tail -4
} > "$out/tests.log" 2>&1
grep -E "passed|failed|FAILED|error" "$out/tests.log"
el "e2e prefetch A/B"
timeout ${E2E_S:-330} python3 -m jax_onnx_attn.bench e2e --models 8b 1b --weights fp16 --batch 1 \
  --ctx 2048 8192 --phases decode --impls ours jax-peer --models-dir /tmp/models --profile first \
  --ours-env pf16:JOA_L2_PREFETCH_MB=16 pf32:JOA_L2_PREFETCH_MB=32 \
             pf32el:JOA_L2_PREFETCH_MB=32,JOA_L2_PREFETCH_MODE=bulk-evict-last \
             pf32ln:JOA_L2_PREFETCH_MB=32,JOA_L2_PREFETCH_MODE=lines \
  --max-seconds ${E2E_MAX_S:-300} --out "$out/e2e_prefetch.json" 2>&1 | grep -v Warning | tail -30 \
  | tee "$out/e2e_prefetch.txt"
el done
