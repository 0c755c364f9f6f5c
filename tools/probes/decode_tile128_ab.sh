#!/usr/bin/env bash
# Issue 15 / 12 on the GPU machine: the decode engine's wide KV tile (JOA_DECODE_TILE128,
# LaunchOptions::tile128: 128-row K / V tiles for 16-row blocks, 32 columns a warp in one softmax
# update, at d64 / d128) against the default 64-row tile and cuDNN. Needs the carried snapshot with a
# prebuilt extension of this tree (here: tools/build_device_ext.sh, then tools/snapshot.sh --so <that
# .so>; carry .snap), and runs in under 4 minutes:
#   bash tools/probes/decode_tile128_ab.sh
# 1) pytest -m gpu tests/gpu/test_decode_tile128_gpu.py (the wide tile against the reference over
#    f16 / bf16, d64 / d128, B 1 / 8 / 32, q_len 1 / 4, ragged lengths, splits / clusters, features,
#    NaN / Inf, where it does not apply, a command-buffer decode loop; bitwise repeatable; 42 cases,
#    -n 4, killed after 90 s).
# 2) bench decode in one process: fp16, 32/8, q_len 1, B 8 / 1 x ctx 2048 / 2304 (the ~1B decoder's
#    cache) / 4096 / 8192 x d 64 / 128, impls ours (the defaults: cursor loads at d128),
#    ours[tile128] (cursor loads at d128, strided at d64), ours[tile128+cursor] (cursor loads at
#    both), jax-cudnn.
# 3) B=32 ctx 16384 (the ~1B decoder's step where ours trails the JAX peer), d 64 / 128.
# To $OUT (5 files): prepare.log, gpu_tests.log, decode_tile128_ab.json, decode_tile128_ab_b32.json,
# decode_tile128_ab.txt.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
timeout 90 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_tile128_gpu.py 2>&1 | tail -40 | tee "$out/gpu_tests.log"
python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 32 \
  --ctx 16384 --qlen 1 --impls ours "ours[tile128]" "ours[tile128+cursor]" jax-cudnn \
  --target-ms 30 --reps 5 --max-seconds 45 --out "$out/decode_tile128_ab_b32.json" 2>&1 \
  | grep -v "us/" | tail -8 | tee "$out/decode_tile128_ab.txt"
python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 8 1 \
  --ctx 2048 2304 4096 8192 --qlen 1 --impls ours "ours[tile128]" "ours[tile128+cursor]" jax-cudnn \
  --target-ms 30 --reps 5 --max-seconds 100 --out "$out/decode_tile128_ab.json" 2>&1 \
  | grep -v "us/" | tail -24 | tee -a "$out/decode_tile128_ab.txt"
