#!/usr/bin/env bash
# Session 29, call B (~8 min): call A's kernel plus the unpack's masks as one lop3 each (ptx::AndOr /
# AndXor). 1) issue 15's headline rows (B=8 / B=1 at 128k, bf16 / fp16, float / int8 / int4 caches,
# jax cuDNN on the float ones) and bf16 per-channel scales; 2) int8 / int4 rows at the grid's
# shorter B=8 contexts beside bf16; 3) the kernel routing (ours[tiles] vs ours[regs]) around
# kQuantRegsMinRows; 4) the GPU tests of the quantised paths.
# To $OUT: prepare.log, dec128k.json, chan.json, grid.json, route.json, tests.log (+ run.log).
# S29_STEPS (default: all five) picks steps: headline channel grid route tests; S29_TESTS the test
# files (default: the five below).
set -uo pipefail
steps=" ${S29_STEPS:-headline channel grid route tests} "
on() { [[ "$steps" == *" $1 "* ]]; }
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
on headline && {
el headline
timeout 120 python3 -m jax_onnx_attn.bench decode --dtypes bf16 fp16 --heads 32/8 --dims 128 --batch 8 1 \
  --ctx 131072 --qlen 1 --kv-bits 0 8 4 --impls ours jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 110 --out "$out/dec128k.json" 2>&1 | grep -v Warning | tail -14
}
on channel && {
el channel
timeout 50 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 8 \
  --ctx 131072 --qlen 1 --kv-bits 8 4 --scales channel --impls ours --target-ms 10 --reps 3 \
  --max-seconds 45 --out "$out/chan.json" 2>&1 | grep -v Warning | tail -4
}
on grid && {
el grid
timeout 70 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 8 \
  --ctx 4096 16384 --qlen 1 --kv-bits 0 8 4 --impls ours jax-cudnn --target-ms 10 --reps 3 \
  --max-seconds 65 --out "$out/grid.json" 2>&1 | grep -v Warning | tail -8
}
on route && {
el route
timeout 100 python3 -m jax_onnx_attn.bench decode --dtypes bf16 --heads 32/8 --dims 128 --batch 1 4 \
  --ctx 4096 8192 16384 --qlen 1 --kv-bits 8 4 --impls ours[tiles] ours[regs] --target-ms 10 --reps 3 \
  --max-seconds 90 --out "$out/route.json" 2>&1 | grep -v Warning | tail -14
}
on tests && {
el tests
tests=${S29_TESTS:-tests/gpu/test_decode_quant_regs_gpu.py tests/gpu/test_decode_quant_gpu.py tests/gpu/test_decode_paths_gpu.py tests/gpu/test_gqa_prepare_gpu.py tests/gpu/test_spmd_gpu.py}
# shellcheck disable=SC2086
timeout 240 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider $tests -k "vmap or not spmd" \
  > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
}
el done
} 2>&1 | tee "$out/run.log"
