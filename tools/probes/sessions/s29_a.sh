#!/usr/bin/env bash
# Session 29, call A (~8 min): the register-dequantised caches with f16 MMAs for every cache dtype
# and whole-tile copies from cursors (issue 15). 1) issue 15's headline rows: B=8 / B=1 at 128k,
# bf16 / fp16 caches and int8 / int4 ones in one run (ours; jax cuDNN on the float caches), and
# bf16 per-channel scales; 2) the kernel routing: ours[tiles] vs ours[regs] at B=1 / B=8 8k-32k;
# 3) the GPU tests of the quantised paths.
# To $OUT: prepare.log, dec128k.json, chan.json, route.json, tests.log, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el headline
timeout 120 python3 -m jax_onnx_attn.bench decode --dtypes bf16 fp16 --heads 32/8 --dims 128 --batch 8 1 \
  --ctx 131072 --qlen 1 --kv-bits 0 8 4 --impls ours jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 110 --out "$out/dec128k.json" 2>&1 | grep -v Warning | tail -14
el channel
timeout 50 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 8 \
  --ctx 131072 --qlen 1 --kv-bits 8 4 --scales channel --impls ours --target-ms 10 --reps 3 \
  --max-seconds 45 --out "$out/chan.json" 2>&1 | grep -v Warning | tail -4
el route
timeout 100 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 1 8 \
  --ctx 4096 8192 32768 --qlen 1 --kv-bits 8 4 --impls ours[tiles] ours[regs] --target-ms 10 --reps 3 \
  --max-seconds 90 --out "$out/route.json" 2>&1 | grep -v Warning | tail -14
el tests
timeout 240 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_quant_regs_gpu.py tests/gpu/test_decode_quant_gpu.py tests/gpu/test_decode_paths_gpu.py \
  tests/gpu/test_gqa_prepare_gpu.py tests/gpu/test_spmd_gpu.py -k "vmap or not spmd" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el done
} 2>&1 | tee "$out/run.log"
