#!/usr/bin/env bash
# Session 29, call E (~5 min): Nsight Compute on the landed register kernel (issue 15) at B=8 128k
# bf16 32/8 d128: int4 and int8 caches (sections), and int4's per-instruction stall samples (the
# source page, SASS), for the next step on int4 (58% of HBM, instruction-bound).
# To $OUT: prepare.log, qregs_ncu.txt, int4_src.csv, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats"
case_args="--batch 8 --ctx 131072 --qlen 1 --dtype bf16 --iters 5"
{
for bits in 4 8; do
  el "int$bits"; echo "=== int$bits" >> "$out/qregs_ncu.txt"
  timeout 120 ncu --clock-control none --kernel-name regex:DecodeSplitKernelQRegs --launch-skip 3 --launch-count 1 \
    $sec python3 tools/profile_decode.py $case_args --kv-bits $bits >> "$out/qregs_ncu.txt" 2>&1
  echo "exit $?" >> "$out/qregs_ncu.txt"
done
el "int4 src"
timeout 120 ncu --clock-control none --kernel-name regex:DecodeSplitKernelQRegs --launch-skip 3 --launch-count 1 \
  --section SourceCounters --section WarpStateStats -o /tmp/int4_src python3 tools/profile_decode.py $case_args --kv-bits 4 \
  > /dev/null 2>&1
ncu -i /tmp/int4_src.ncu-rep --page source --csv --print-source sass > "$out/int4_src.csv" 2>&1
el done
} 2>&1 | tee "$out/run.log"
grep -E "^===|Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps|Warp Cycles Per Issued|Executed Ipc|Registers Per|Achieved Active|exit" "$out/qregs_ncu.txt" | cut -c1-150 | head -60
ls -la "$out"
