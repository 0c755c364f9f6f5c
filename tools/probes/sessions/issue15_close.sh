#!/usr/bin/env bash
# The session-19 last call (~7 min): 1) Nsight Compute on ours' causal B16 S1k d128 prefill (the call
# before segfaulted there under kernel replay: application replay this time); 2) issue 15's decode grid
# at the landed commit (bf16 / int8 / int4 caches, B 1 / 8, ctx 4k / 8k / 128k, 32/8 d128, jax cuDNN
# beside); 3) the ~1B fp16 decode cases issue 12's grid skipped (B 32, ctx 16k).
# To $OUT: prepare.log, ncu2.txt, dec.json, e2e_1b_fp16.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
sec="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
{
el ncu
timeout 90 ncu --clock-control none --replay-mode application --kernel-name regex:PrefillKernel --launch-skip 2 \
  --launch-count 1 $sec python3 tools/probes/prefill_ncu_case.py ours 16 1024 causal > "$out/ncu2.txt" 2>&1
echo "ncu exit $?"
grep -E "Duration|Elapsed Cycles|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Grid Size|Achieved Occupancy|Shared is|highest" "$out/ncu2.txt" | head -20
el decode
timeout 170 python3 -m jax_onnx_attn.bench decode --batch 1 8 --ctx 4096 8192 131072 --qlen 1 --heads 32/8 --dims 128 \
  --dtypes bf16 --kv-bits 0 8 4 --impls ours jax-cudnn --target-ms 10 --reps 3 --max-seconds 150 \
  --out "$out/dec.json" 2>&1 | tail -24
el e2e
timeout 200 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 --batch 1 32 --ctx 1024 16384 \
  --phases decode --impls ours jax-peer --max-seconds 170 --models-dir /tmp/models \
  --out "$out/e2e_1b_fp16.json" 2>&1 | grep -v Warning | tail -14
el done
} 2>&1 | tee "$out/run.log"
