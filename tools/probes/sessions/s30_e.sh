#!/usr/bin/env bash
# Session 30, call E (~6 min): the landed form of the key rows (DecodeSplitKernelQRegs<..., true>,
# key_rows.cuh; the float kernel's form measured in call C and not landed). 1) the GPU tests of the
# register path (both forms), the quantised tile path, gqa_prepare feeding it and the vmap fold;
# 2) issue 15's headline rows again at this build: B=8 / B=1 128k bf16 / fp16, float / int8 / int4
# caches ("ours": key rows on int caches; "ours[query-rows]"), jax cuDNN beside.
# To $OUT: prepare.log, tests.log, dec128k.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 250 python3 -m pytest -m gpu -q -ra -n 16 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_quant_regs_gpu.py tests/gpu/test_decode_quant_gpu.py tests/gpu/test_gqa_prepare_gpu.py \
  tests/gpu/test_spmd_gpu.py -k "vmap or not spmd" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el headline
timeout 170 python3 -m jax_onnx_attn.bench decode --dtypes bf16 fp16 --heads 32/8 --dims 128 --batch 8 1 \
  --ctx 131072 --qlen 1 --kv-bits 0 8 4 --impls ours ours[query-rows] jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 160 --out "$out/dec128k.json" 2>&1 | grep -v Warning | tail -14
el done
} 2>&1 | tee "$out/run.log"
