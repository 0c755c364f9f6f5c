#!/usr/bin/env bash
# Session 21, second call (~5 min): the int4 rows kernel's device time per call at the ~1B shapes
# (tools/probes/rows_kernel_times.py, profiler kernel events), then Nsight Compute on the planned
# qkv / down projections at M 32 (no preallocation, command buffers off: kernel replay of a small
# process). To $OUT: prepare.log, times.json, times.log, ncu.txt.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 300 python3 tools/probes/rows_kernel_times.py "$out/times.json" > "$out/times.log" 2>&1; echo "times exit $?" >> "$out/times.log"
export XLA_FLAGS=--xla_gpu_enable_command_buffer=
sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
for c in "2048 3072 32" "8192 2048 32" "2048 16384 32"; do
  echo "=== $c" >> "$out/ncu.txt"
  timeout 90 ncu --clock-control none --kernel-name regex:GemvRowsKernel --launch-skip 2 --launch-count 1 \
    $sec python3 tools/probes/rows_ncu_case.py $c >> "$out/ncu.txt" 2>&1
  echo "exit $?" >> "$out/ncu.txt"
done
tail -5 "$out/times.log"
grep -E "^===|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|No Eligible|Registers Per|Achieved Occupancy|Grid Size|Cluster Size|Stall|exit" "$out/ncu.txt" | head -80
