#!/usr/bin/env bash
# Session 22's first call (~7 min): the rows kernel's RMS-norm sums in a tile-independent order.
# 1) its GPU test file (values vs the reference, the vmap fold with the norm, bits, command buffers);
# 2) the planned layouts' device time per call at the ~8B shapes; 3) Nsight Compute on the ring
# kernel's planned down / gate-up projections at M 32 (~1B shapes: where its time goes); 4) the
# slots kernel's record reader (B=1) per call at the ~1B / ~8B shapes, and ncu on the ~8B gate-up.
# To $OUT: prepare.log, tests.log, times.json, ncu.txt, record.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 150 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_linear_rows_gpu.py \
  > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -2 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el times
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 tools/probes/rows_kernel_times.py "$out/times.json" planned 8b 2>&1 | cut -c1-200 | tail -12
el ncu
export XLA_PYTHON_CLIENT_PREALLOCATE=false
sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats"
for c in "8192 2048 32" "2048 16384 32"; do
  echo "=== $c" >> "$out/ncu.txt"
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 70 ncu --clock-control none --kernel-name regex:GemvRowsKernel \
    --launch-skip 2 --launch-count 1 $sec --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python3 tools/probes/rows_ncu_case.py $c >> "$out/ncu.txt" 2>&1
  echo "exit $?" >> "$out/ncu.txt"
done
el record
timeout 100 python3 tools/probes/record_kernel_times.py "$out/record.json" 2>&1 | cut -c1-220 | tail -11
echo "=== record 4096 28672" >> "$out/ncu.txt"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 70 ncu --clock-control none --kernel-name regex:GemvSlotsKernel \
  --launch-skip 2 --launch-count 1 $sec --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  python3 tools/probes/record_ncu_case.py 4096 28672 >> "$out/ncu.txt" 2>&1
echo "exit $?" >> "$out/ncu.txt"
grep -E "^===|Duration|Compute \(SM\) Throughput|DRAM Throughput|Issue Slots Busy|No Eligible|Registers Per|Stall|exit" "$out/ncu.txt" | head -60
el done
} 2>&1 | tee "$out/run.log"
