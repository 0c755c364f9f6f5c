#!/usr/bin/env bash
# Session 30, call B (~8 min): the key-rows register kernel (engine_key_rows.cuh, the default where
# a block holds <= 8 query rows). 1) the other GPU tests that run the register path by default (the
# quantised tile path, the decode paths, gqa_prepare's quantise-on-write feeding it, the vmap
# fold); 2) Nsight Compute on the key-rows int4 kernel at B=8 128k bf16 32/8 d128 (sections), for
# what is left of its loop.
# To $OUT: prepare.log, tests.log, keyrows_ncu.txt, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 300 python3 -m pytest -m gpu -q -ra -n 16 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_quant_gpu.py tests/gpu/test_decode_paths_gpu.py tests/gpu/test_gqa_prepare_gpu.py \
  tests/gpu/test_spmd_gpu.py -k "vmap or not spmd" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
export XLA_PYTHON_CLIENT_PREALLOCATE=false
sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats"
el ncu
timeout 150 ncu --clock-control none --kernel-name regex:DecodeSplitKernelKeyRows --launch-skip 3 --launch-count 1 \
  $sec python3 tools/profile_decode.py --batch 8 --ctx 131072 --qlen 1 --dtype bf16 --iters 5 --kv-bits 4 \
  > "$out/keyrows_ncu.txt" 2>&1
echo "ncu exit $?"
grep -E "Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps|Warp Cycles Per Issued|Executed Ipc|Registers Per|Achieved Active|Executed Instructions  " "$out/keyrows_ncu.txt" | cut -c1-150 | head -20
el done
} 2>&1 | tee "$out/run.log"
