#!/usr/bin/env bash
# Issue 18 on two GPUs (the device tool's kind nvidia-h200-x2): the SPMD tests (tests/gpu/
# test_spmd_gpu.py: our kernels under vmap, split over two GPUs, and the tensor-parallel session
# against one GPU), then the e2e bench of ours on 1 and 2 GPUs (decode ms/step and tokens/s; the
# 8B-class fp16 model at B=1 and B=8 by default). Usage (carry .snap from tools/snapshot.sh):
#   bash tools/device_multi_gpu.sh ["<bench e2e args>"]
# Files under $OUT: prepare.log, spmd_tests.log, e2e_tp.json.
set -uo pipefail
export NCCL_NVLS_ENABLE=0  # no NVLink multicast on the shared hosts (the device tool's KINDS.md)
source "$(dirname "$0")/device_prepare.sh"
e2e_args=${1:---models 8b --weights fp16 --batch 1 8 --ctx 2048 --impls ours --phases decode --devices 1 2 --max-seconds 420}
python3 -c "import jax; print('devices:', jax.devices())" | tee -a "$out/prepare.log"
timeout 300 python3 -m pytest -m gpu -q -ra -x -s -n 0 -p no:cacheprovider tests/gpu/test_spmd_gpu.py \
  > "$out/spmd_tests.log" 2>&1
ok=$?
tail -8 "$out/spmd_tests.log"
[ $ok -ne 0 ] && grep -E "^E |Error|FAILED" "$out/spmd_tests.log" | head -30
if [ $ok -eq 0 ] && [ "$e2e_args" != none ]; then
  python3 -m jax_onnx_attn.bench e2e $e2e_args --out "$out/e2e_tp.json" 2>&1 | grep -v Warning | tail -40
else
  echo "e2e skipped (SPMD tests failed: rc $ok)"
fi
