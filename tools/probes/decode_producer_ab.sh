#!/usr/bin/env bash
# Issue 15 / 12 on the GPU machine: the decode engine's producer warp (JOA_DECODE_PRODUCER,
# LaunchOptions::producer: one extra warp issues the K / V copies into an mbarrier ring, sm_90)
# against the engine without it and cuDNN. Needs the carried snapshot with a prebuilt extension of
# this tree (here: tools/build_device_ext.sh, then tools/snapshot.sh --so <that .so>; carry .snap),
# and runs in under 4 minutes:
#   bash tools/probes/decode_producer_ab.sh
# 1) pytest -m gpu tests/gpu/test_decode_producer_gpu.py (the producer's bits against the default
#    engine's over head dims, layouts, ragged lengths, splits / clusters, features, NaN / Inf, and a
#    command-buffer decode loop; 49 cases, -n 4, killed after 80 s).
# 2) bench decode in one process: fp16, 32/8, q_len 1, B 8 / 1 x ctx 2048 / 2304 (the ~1B decoder's
#    cache) / 4096 / 8192 x d 64 / 128 (16 cases, B=8 first), impls ours (the defaults: cursor loads
#    at d128), ours[producer], jax-cudnn.
# To $OUT (5 files): prepare.log, gpu_tests.log, decode_producer_ab.json, decode_producer_ab_b32.json,
# decode_producer_ab.txt.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
timeout 80 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_producer_gpu.py 2>&1 | tail -40 | tee "$out/gpu_tests.log"
python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 8 1 \
  --ctx 2048 2304 4096 8192 --qlen 1 --impls ours "ours[producer]" jax-cudnn \
  --target-ms 30 --reps 5 --max-seconds 110 --out "$out/decode_producer_ab.json" 2>&1 \
  | grep -v "us/" | tail -24 | tee "$out/decode_producer_ab.txt"
# 3) the large-batch cases where the whole-model grid has ours behind the JAX peer (~1B B=32 16k,
#    ~8B B=8 8k): B 32 x 16k and B 8 x 8k, d 64 / 128 (bench/results/2026-12-02-0fccfd4-e2e-grid-*.json).
python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 32 \
  --ctx 16384 --qlen 1 --impls ours "ours[producer]" jax-cudnn \
  --target-ms 30 --reps 5 --max-seconds 45 --out "$out/decode_producer_ab_b32.json" 2>&1 \
  | grep -v "us/" | tail -8 | tee -a "$out/decode_producer_ab.txt"
