#!/usr/bin/env bash
# Session 21 (~8 min): the prefill GPU files owed by the SM-count clean-up, then the int4 rows kernel
# at the ~1B decoder's shapes: a plan sweep at M 8 / 32 beside XLA (dense fp16 and dequantise + dot),
# and Nsight Compute on the planned qkv / down projections at M 32.
# To $OUT: prepare.log, tests.log, rows.json, bench.log, ncu.txt.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 330 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider \
  tests/gpu/test_prefill_persistent_gpu.py tests/gpu/test_prefill_engine_gpu.py tests/gpu/test_prefill_split_gpu.py 2>&1 | tail -15
} > "$out/tests.log" 2>&1
{
el bench
timeout 200 python3 -m jax_onnx_attn.bench linear --shapes 2048x3072 8192x2048 2048x16384 2048x2048 2048x128256 \
  --rows 8 32 --formats int4 fp16 --impls xla-nk --rows-plans 1,8,2 2,8,2 4,8,2 8,8,2 2,4,4 4,4,4 8,4,4 16,4,4 4,2,4 8,2,4 16,2,4 \
  --target-ms 5 --reps 3 --max-seconds 180 --out "$out/rows.json" 2>&1 | tail -40
el ncu
} > "$out/bench.log" 2>&1
sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
for c in "2048 3072 32" "8192 2048 32" "2048 16384 32" "2048 3072 8"; do
  echo "=== $c" >> "$out/ncu.txt"
  timeout 60 ncu --clock-control none --target-processes all --kernel-name regex:GemvRowsKernel --launch-skip 2 --launch-count 1 \
    $sec python3 tools/probes/rows_ncu_case.py $c >> "$out/ncu.txt" 2>&1
  echo "exit $?" >> "$out/ncu.txt"
done
el done >> "$out/bench.log"
cat "$out/tests.log" "$out/bench.log"
grep -E "^===|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|No Eligible|Registers Per|Achieved Occupancy|Grid Size|Cluster Size|Stall|exit" "$out/ncu.txt" | head -80
