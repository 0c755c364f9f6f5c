#!/usr/bin/env bash
# Session 25, second call (~9 min): the dense rows kernel's full-line load map (JOA_DENSE_ROWS_LOADS=
# full, the session's knob) through the dense linear GPU tests; the combine's one-trip merge of up
# to 32 splits (split_merge.cuh) through the decode engine's and the split prefill's GPU tests and
# the NaN / Inf semantics; then the dense rows variants' device time per call beside the ring kernel
# and XLA's dot; then decode attention against jax cuDNN (fp16 32/8, B 8 / 1, ctx 2304-8192, d64 / d128).
# To $OUT: prepare.log, tests_rows.log, tests_combine.log, times.json, dec.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests_rows
JOA_DENSE_ROWS_LOADS=full JOA_DENSE_ROWS_CARVEOUT=fit timeout 110 python3 -m pytest -m gpu -q -ra -n 8 --dist load \
  -p no:cacheprovider tests/gpu/test_linear_gpu.py -k "dense or every_output or loop" > "$out/tests_rows.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests_rows.log"; grep -E "^(FAILED|ERROR)" "$out/tests_rows.log" | head -8
el tests_combine
timeout 200 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_decode_attention_gpu.py \
  tests/gpu/test_prefill_split_gpu.py tests/gpu/test_nan_inf_gpu.py -k "not test_shapes or (float16 and 128)" \
  > "$out/tests_combine.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests_combine.log"; grep -E "^(FAILED|ERROR)" "$out/tests_combine.log" | head -8
el times
timeout 170 python3 tools/probes/dense_rows_times.py "$out/times.json" 2>&1 | grep -v Warning | tail -32
el decode
timeout 90 python3 -m jax_onnx_attn.bench decode --dtypes fp16 --heads 32/8 --dims 64 128 --batch 8 1 \
  --ctx 2304 4096 8192 --qlen 1 --impls ours jax-cudnn --target-ms 20 --reps 5 --max-seconds 80 \
  --out "$out/dec.json" 2>&1 | grep -v "us/" | tail -14
el done
} 2>&1 | tee "$out/run.log"
