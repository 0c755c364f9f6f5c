#!/usr/bin/env bash
# Session 30, call A (~9 min): the key-rows register kernel (engine_key_rows.cuh: keys as the MMA
# rows, LaunchOptions::key_rows) against the query-rows one (engine_qregs.cuh) in one process.
# 1) the GPU tests of the register path (both kernels: the tests' `kernel` fixture); 2) issue 15's
# headline rows (B=8 / B=1 128k, bf16 / fp16; "ours" takes the key rows on int caches, the float
# cache and jax cuDNN beside); 3) per-channel scales; 4) the B=8 4k / 16k and B=1 8k / 16k rows.
# To $OUT: prepare.log, tests.log, dec128k.json, chan.json, grid.json, run.log.
# S30_STEPS picks steps (default: tests headline channel grid).
set -uo pipefail
steps=" ${S30_STEPS:-tests headline channel grid} "
on() { [[ "$steps" == *" $1 "* ]]; }
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
on tests && {
el tests
timeout 230 python3 -m pytest -m gpu -q -ra -n 16 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_quant_regs_gpu.py > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
}
on headline && {
el headline
timeout 160 python3 -m jax_onnx_attn.bench decode --dtypes bf16 fp16 --heads 32/8 --dims 128 --batch 8 1 \
  --ctx 131072 --qlen 1 --kv-bits 0 8 4 --impls ours ours[query-rows] jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 150 --out "$out/dec128k.json" 2>&1 | grep -v Warning | tail -14
}
on channel && {
el channel
timeout 60 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 8 \
  --ctx 131072 --qlen 1 --kv-bits 8 4 --scales channel --impls ours ours[query-rows] --target-ms 10 --reps 3 \
  --max-seconds 55 --out "$out/chan.json" 2>&1 | grep -v Warning | tail -4
}
on grid && {
el grid
timeout 90 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 8 1 \
  --ctx 4096 16384 --qlen 1 --kv-bits 0 8 4 --impls ours ours[key-rows] ours[query-rows] jax-cudnn \
  --target-ms 10 --reps 3 --max-seconds 85 --out "$out/grid.json" 2>&1 | grep -v Warning | tail -16
}
el done
} 2>&1 | tee "$out/run.log"
