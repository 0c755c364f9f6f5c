#!/usr/bin/env bash
# Issue 14 on the GPU machine: the tuned pingpong kernels of branch prefill-perf2 (params.h Tune,
# docs/kernels.md "Main-loop tunings"), first run, in about 3.5 minutes (at most ~4.3 at every timeout).
# Needs the carried snapshot with a prebuilt extension of this tree (tools/build_device_ext.sh, then
# tools/snapshot.sh --so <that .so>; carry ".snap"):
#   bash tools/probes/prefill_perf2_ab.sh
# 1) the new GPU tests (-k tuned, 4 workers): each tuned schedule against the spec, "-lazy" bit for bit
#    against its base, repeatability, the fall-back to pingpong where none is compiled;
# 2) the prefill bench, bf16 GQA 32/8 d128, B·S = 16k, S 1k / 4k / 16k, causal and not: ours (default,
#    pingpong), each tuned schedule and jax cuDNN in one process. SKIP_BENCH=1 skips it.
# To $OUT (5 files): prepare.log, prefill_perf2_tests.log, prefill_perf2_bench.json (S 4k),
# prefill_perf2_bench_1k_16k.json and prefill_perf2_bench.txt (both tables).
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
python3 -c "from jax_onnx_attn.ops import cuda; print('schedules', cuda.PREFILL_SCHEDULES)" | tee -a "$out/prepare.log"
timeout 90 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider \
  tests/gpu/test_prefill_engine_gpu.py -k tuned > "$out/prefill_perf2_tests.log" 2>&1
echo "tests: exit $?"; tail -25 "$out/prefill_perf2_tests.log"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  B="python3 -m jax_onnx_attn.bench prefill --heads 32/8 --dtypes bf16 --tokens 16384 --dims 128
     --causal causal noncausal --calls 4 --target-ms 20 --reps 3
     --impls ours ours-pingpong-fold ours-pingpong-lazy ours-pingpong-fold-lazy ours-pingpong-n176
             ours-pingpong-fold-lazy-n176 jax-cudnn"
  timeout 65 $B --seqlens 4096 --max-seconds 50 --out "$out/prefill_perf2_bench.json" 2>&1 |
    tee "$out/prefill_perf2_bench.txt"
  timeout 90 $B --seqlens 1024 16384 --max-seconds 70 --out "$out/prefill_perf2_bench_1k_16k.json" 2>&1 |
    tee -a "$out/prefill_perf2_bench.txt"
fi
