#!/usr/bin/env bash
# What session 16 landed without a GPU run, in one device call (~6 min), in priority order, outputs
# straight to $OUT (a timeout keeps what finished). Build and carry the snapshot first
# (tools/build_device_ext.sh, tools/snapshot.sh --so <.so>; carry ".snap"), then from the repo root:
#   bash .snap/tools/probes/sessions/pending_gpu_s16.sh
# 1) the ai.onnx Attention prefill route (on by default on sm_90) and the decode paths it changed;
# 2) the decode engine's 128-row KV tiles (JOA_DECODE_TILE128): GPU file, then ours / ours[tile128] /
#    cuDNN at B=32 16k and B 8 / 1 x 2304 / 8192, d64 / d128;
# 3) the prefill engine's opt-in main-loop tunings: GPU tests (-k tuned), then bf16 32/8 d128 at S 4k /
#    16k, causal and not, against the default and cuDNN.
# To $OUT (8 files): prepare.log, route_tests.log, tile128_tests.log, decode_tile128_b32.json,
# decode_tile128_ab.json, prefill_tests.log, prefill_perf2_bench.json, and nothing else.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PT="python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider"
el "attention prefill route tests"
timeout 90 $PT tests/gpu/test_attention_prefill_route_gpu.py tests/gpu/test_decode_paths_gpu.py \
  > "$out/route_tests.log" 2>&1; echo "exit $?"; tail -5 "$out/route_tests.log"
el "tile128 tests"
timeout 80 $PT tests/gpu/test_decode_tile128_gpu.py > "$out/tile128_tests.log" 2>&1; echo "exit $?"
tail -4 "$out/tile128_tests.log"
el "decode bench"
timeout 45 python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 32 \
  --ctx 16384 --qlen 1 --impls ours "ours[tile128]" jax-cudnn \
  --target-ms 25 --reps 3 --max-seconds 35 --out "$out/decode_tile128_b32.json" 2>&1 | grep -v "us/" | tail -5
timeout 70 python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 8 1 \
  --ctx 2304 8192 --qlen 1 --impls ours "ours[tile128]" jax-cudnn \
  --target-ms 25 --reps 3 --max-seconds 55 --out "$out/decode_tile128_ab.json" 2>&1 | grep -v "us/" | tail -12
el "prefill tuned tests"
timeout 90 $PT tests/gpu/test_prefill_engine_gpu.py -k tuned > "$out/prefill_tests.log" 2>&1; echo "exit $?"
tail -4 "$out/prefill_tests.log"
el "prefill bench"
timeout 80 python3 -m jax_onnx_attn.bench prefill --heads 32/8 --dtypes bf16 --tokens 16384 --dims 128 \
  --causal causal noncausal --calls 4 --target-ms 20 --reps 3 --seqlens 4096 16384 \
  --impls ours ours-pingpong-fold ours-pingpong-fold-lazy ours-pingpong-n176 ours-pingpong-fold-lazy-n176 jax-cudnn \
  --max-seconds 65 --out "$out/prefill_perf2_bench.json" 2>&1 | tail -6
el done
