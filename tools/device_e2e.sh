#!/usr/bin/env bash
# One device call for whole-model speed: the GEMV kernels' GPU tests, their micro-bench, then (only
# if the kernels pass) the e2e bench. Usage (carry .snap from tools/snapshot.sh):
#   bash tools/device_e2e.sh "<bench e2e args>" "<bench linear args>"
# Files under $OUT: prepare.log, gpu_tests.log, linear.json, e2e.json (a call returns at most 8).
set -uo pipefail
source "$(dirname "$0")/device_prepare.sh"
e2e_args=${1:---quick}
linear_args=${2:---formats fp16 int4 --rows 1 8 32 --max-seconds 50}
timeout 200 python3 -m pytest -m gpu -q -x -n 0 -p no:cacheprovider ${GPU_TESTS:-tests/gpu/test_linear_gpu.py} \
  > "$out/gpu_tests.log" 2>&1
ok=$?
tail -5 "$out/gpu_tests.log"
[ $ok -ne 0 ] && grep -E "^E |Error|FAILED" "$out/gpu_tests.log" | head -30
if [ -n "$linear_args" ] && [ "$linear_args" != none ]; then
  timeout 150 python3 -m jax_onnx_attn.bench linear $linear_args --out "$out/linear.json" 2>&1 | grep -v Warning | tail -40
fi
if [ $ok -eq 0 ] && [ "$e2e_args" != none ]; then
  python3 -m jax_onnx_attn.bench e2e $e2e_args --out "$out/e2e.json" 2>&1 | grep -v Warning | tail -70
else
  echo "e2e skipped (GPU tests failed: rc $ok)"
fi
