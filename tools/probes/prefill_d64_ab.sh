#!/usr/bin/env bash
# Issue 14 on the GPU machine: the D 64 tilings of branch prefill-d64 (params.h kTuneN192 /
# kTuneDeepKV / kTuneM192, docs/kernels.md "D 64 tilings"), first run, in about 6 minutes (at most
# ~9.5 at every timeout). Needs the carried snapshot with a prebuilt extension of this tree
# (tools/build_device_ext.sh, then tools/snapshot.sh --so <that .so>; carry ".snap"):
#   bash tools/probes/prefill_d64_ab.sh
# 1) the tuned GPU tests (-k tuned, 4 workers; the D 64 ones carry d64): each tuned schedule against
#    the spec, the bit-identities (lazy, -s4, -m192), repeatability, the fall-back to pingpong;
# 2) the prefill bench, bf16 GQA 32/8 d64, B·S = 16k, S 1k / 2k / 4k, causal and not: ours (default,
#    pingpong), the D 64 tuned schedules, jax cuDNN and torch cuDNN in one process. SKIP_BENCH=1
#    skips it.
# To $OUT (4 files): prepare.log, prefill_d64_tests.log, prefill_d64_bench.json, prefill_d64_bench.txt.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
python3 -c "from jax_onnx_attn.ops import cuda; print('schedules', cuda.PREFILL_SCHEDULES)" | tee -a "$out/prepare.log"
timeout 300 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider \
  tests/gpu/test_prefill_engine_gpu.py -k tuned > "$out/prefill_d64_tests.log" 2>&1
echo "tests: exit $?"; tail -25 "$out/prefill_d64_tests.log"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 230 python3 -m jax_onnx_attn.bench prefill --heads 32/8 --dtypes bf16 --tokens 16384 --dims 64 \
    --seqlens 1024 2048 4096 --causal causal noncausal --calls 4 --target-ms 20 --reps 3 --max-seconds 200 \
    --impls ours ours-pingpong-fold-lazy ours-pingpong-fold-lazy-s4 ours-pingpong-n192 ours-pingpong-fold-lazy-n192 \
            ours-pingpong-fold-lazy-n192-s4 ours-pingpong-fold-lazy-m192 ours-pingpong-fold-lazy-m192-s4 \
            jax-cudnn torch-cudnn \
    --out "$out/prefill_d64_bench.json" 2>&1 | tee "$out/prefill_d64_bench.txt"
fi
