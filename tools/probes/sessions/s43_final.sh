#!/usr/bin/env bash
# Session 43's last device call (~4 min): the GPU tests of the kernels beside the 4-bit fused MLP
# that was taken out (tools/patches/fused-mlp-nbits/: the dense fused MLP and out_mlp share its
# handler file, the record kernels its slots math; the session rules), then ~8B int4 B=1 2k
# profiled, read by `bench breakdown` with the wall-time column (e2e.kernel_wall_times).
# To $OUT: prepare.log, gpu_tests.log, e2e_8b_int4.json, breakdown.txt.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
timeout 240 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/gpu/test_gated_mlp_gpu.py \
  tests/gpu/test_out_mlp_gpu.py tests/gpu/test_linear_record_gpu.py tests/gpu/test_session_gpu.py \
  > "$out/gpu_tests.log" 2>&1
tail -6 "$out/gpu_tests.log"
timeout 150 python3 -m jax_onnx_attn.bench e2e --models 8b --weights int4 --batch 1 --ctx 2048 \
  --phases decode --impls ours --profile first --models-dir /tmp/models --max-seconds 130 \
  --out "$out/e2e_8b_int4.json" 2>&1 | grep -v Warning | tail -4
python3 -m jax_onnx_attn.bench breakdown "$out/e2e_8b_int4.json" 2>&1 | tee "$out/breakdown.txt"
