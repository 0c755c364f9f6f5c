#!/usr/bin/env bash
# Session 24, first call (~6 min): Nsight Compute on the two biggest pieces of the ~8B int4 B=8
# step before changing either: the rows kernel (gate-up / down at M 8, down at M 32, planned) and
# the decode attention at B=8 capacity 2304 d128 (ours: split + combine kernels; jax cuDNN beside
# it), sections + per-instruction stall samples (the source page, SASS) of the rows gate-up and
# the decode split kernel. To $OUT: prepare.log, rows_ncu.txt, dec_ncu.txt, rows_src.csv,
# dec_src.csv, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_enable_command_buffer=
P=/tmp/joa/tools/probes
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section SourceCounters"
{
for c in "4096 28672 8" "14336 4096 8" "14336 4096 32"; do
  el "rows $c"; echo "=== rows $c" >> "$out/rows_ncu.txt"
  timeout 100 ncu --clock-control none --kernel-name regex:GemvRowsKernel --launch-skip 2 --launch-count 1 \
    $sec python3 $P/rows_ncu_case.py $c >> "$out/rows_ncu.txt" 2>&1; echo "exit $?" >> "$out/rows_ncu.txt"
done
el "rows src"
timeout 100 ncu --clock-control none --kernel-name regex:GemvRowsKernel --launch-skip 2 --launch-count 1 \
  --section SourceCounters --section WarpStateStats -o /tmp/rows_src python3 $P/rows_ncu_case.py 4096 28672 8 > /dev/null 2>&1
ncu -i /tmp/rows_src.ncu-rep --page source --csv --print-source sass > "$out/rows_src.csv" 2>&1
for i in ours cudnn; do
  el "decode $i"; echo "=== decode $i" >> "$out/dec_ncu.txt"
  timeout 100 ncu --clock-control none --kernel-name regex:'Decode|flash|fmha|cudnn|sm80|sm90|reduction' --launch-skip 2 --launch-count 4 \
    $sec python3 $P/decode_ncu_case.py $i >> "$out/dec_ncu.txt" 2>&1; echo "exit $?" >> "$out/dec_ncu.txt"
done
el "decode src"
timeout 100 ncu --clock-control none --kernel-name regex:DecodeSplitKernel --launch-skip 2 --launch-count 1 \
  --section SourceCounters --section WarpStateStats -o /tmp/dec_src python3 $P/decode_ncu_case.py ours > /dev/null 2>&1
ncu -i /tmp/dec_src.ncu-rep --page source --csv --print-source sass > "$out/dec_src.csv" 2>&1
el done
} 2>&1 | tee "$out/run.log"
grep -E "^===|Duration|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps|Warp Cycles Per Issued|Grid Size|Registers Per|Achieved Active|exit|  [a-zA-Z_]*Kernel|flash|reduction" "$out/rows_ncu.txt" "$out/dec_ncu.txt" | cut -c1-160 | head -120
ls -la "$out"
