#!/usr/bin/env bash
# Issue 15 on the GPU machine: the decode engine's options against its defaults and cuDNN, in one
# process on the same inputs, then the GPU tests of the options. Needs the carried snapshot with a
# prebuilt extension of this tree (here: tools/build_device_ext.sh, then
# tools/snapshot.sh --so <that .so>; carry .snap), and runs in about 3.5 minutes:
#   bash tools/probes/decode_b8_ab.sh
# The bench: fp16, 32/8, q_len 1, B 1 / 8 x ctx 2k / 4k / 8k x d 64 / 128 (12 cases, B=8 first),
# impls ours (the defaults: ladder plan, strided loads), ours[fit] (JOA_DECODE_PLAN=fit: clusters
# sized to one wave), ours[cursor] (JOA_DECODE_CURSOR_LOADS=1: tiles copied from row cursors),
# ours[fit+cursor], jax-cudnn. Then pytest -m gpu on the options' tests (a fast subset: fp16, d64 /
# d128, 16- to 128-row blocks; every fit case; the command-buffer loop with both switches on).
# To $OUT (4 files): prepare.log, decode_b8_ab.json, decode_b8_ab.txt (the table), gpu_tests.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 8 1 \
  --ctx 2048 4096 8192 --qlen 1 --impls ours "ours[fit]" "ours[cursor]" "ours[fit+cursor]" jax-cudnn \
  --target-ms 30 --reps 5 --max-seconds 140 --out "$out/decode_b8_ab.json" 2>&1 \
  | grep -v "us/" | tail -24 | tee "$out/decode_b8_ab.txt"
python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider tests/gpu/test_decode_attention_gpu.py \
  -k "fit_plan_policy or cursor_loads_with_every_feature or with_the_options or (cursor_loads_give and fp16 and (d64 or d128) and (32q8kv_s1 or 64q8kv_s32 or 6q2kv_s5))" \
  2>&1 | tail -40 | tee "$out/gpu_tests.log"
