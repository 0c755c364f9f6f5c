#!/usr/bin/env bash
# Session 30, call C (~9 min): the key-rows form of the float decode kernel (DecodeSplitKernel
# <..., kKeyRows>, key_rows.cuh) and of the quantised tile kernel. 1) GPU tests with the key rows
# forced for every cache (JOA_DECODE_KEY_ROWS=1: the float decode sweep, NaN / Inf, the quantised
# tile path, the decode paths); 2) A/B in one process, bf16 / fp16 32/8 d128: the float cache's
# query rows (ours) vs key rows (ours[dense-key-rows]) vs jax cuDNN at B=1 2k-128k and B=8 4k-16k;
# 3) the quantised tile kernel (now key rows) vs the register kernel around the route's threshold.
# To $OUT: prepare.log, tests.log, float.json, route.json, run.log. S30_STEPS picks steps.
set -uo pipefail
steps=" ${S30_STEPS:-tests float route} "
on() { [[ "$steps" == *" $1 "* ]]; }
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
on tests && {
el tests
JOA_DECODE_KEY_ROWS=1 timeout 230 python3 -m pytest -m gpu -q -ra -n 16 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_attention_gpu.py tests/gpu/test_nan_inf_gpu.py tests/gpu/test_decode_quant_gpu.py \
  tests/gpu/test_decode_paths_gpu.py > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
}
on float && {
el float
timeout 130 python3 -m jax_onnx_attn.bench decode --dtypes bf16 fp16 --heads 32/8 --dims 128 --batch 1 \
  --ctx 2048 4096 8192 16384 131072 --qlen 1 --kv-bits 0 --impls ours ours[dense-key-rows] jax-cudnn \
  --target-ms 10 --reps 3 --max-seconds 120 --out "$out/float.json" 2>&1 | grep -v Warning | tail -12
timeout 70 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 8 \
  --ctx 4096 16384 --qlen 1 --kv-bits 0 --impls ours ours[dense-key-rows] jax-cudnn \
  --target-ms 10 --reps 3 --max-seconds 60 --out "$out/float_b8.json" 2>&1 | grep -v Warning | tail -4
}
on route && {
el route
timeout 60 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 1 \
  --ctx 4096 16384 --qlen 1 --kv-bits 8 4 --impls ours[tiles] ours[regs] --target-ms 10 --reps 3 \
  --max-seconds 50 --out "$out/route.json" 2>&1 | grep -v Warning | tail -8
}
el done
} 2>&1 | tee "$out/run.log"
