#!/usr/bin/env bash
# Issue 14 at the landed commit (~8 min): the prefill bench over the issue's D 128 targets (causal and
# not, S 1k / 2k / 4k / 16k, B·S 16k, bf16 32/8) beside jax cuDNN and torch (flash, cuDNN), fp16
# with Mosaic at 4k / 16k, D 64 / 256 at 4k, the chunked 2k on 30k and few-query q16 B8 on 32k;
# then Nsight Compute on the misses (ours and jax cuDNN: non-causal B4 S4k, causal B16 S1k; ours
# d64 causal B4 S4k), one launch each, the sections that say what limits a kernel.
# To $OUT: prepare.log, pf_d128.json, pf_other.json, fewq.json, ncu.txt, bench.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el d128
timeout 150 python3 -m jax_onnx_attn.bench prefill --heads 32/8 --dtypes bf16 --tokens 16384 --dims 128 \
  --seqlens 1024 2048 4096 16384 --causal causal noncausal --target-ms 20 --reps 3 --max-seconds 130 \
  --impls ours jax-cudnn torch-cudnn torch-flash --out "$out/pf_d128.json" 2>&1 | tail -12
el other
timeout 130 python3 -m jax_onnx_attn.bench prefill --heads 32/8 --dtypes fp16 --tokens 16384 --dims 128 \
  --seqlens 4096 16384 --causal causal noncausal --chunked 2048:30720 --target-ms 20 --reps 3 --max-seconds 110 \
  --impls ours jax-cudnn jax-mosaic torch-cudnn --out "$out/pf_other.json" 2>&1 | tail -10
timeout 60 python3 -m jax_onnx_attn.bench decode --batch 8 --ctx 32768 --qlen 16 --heads 32/8 --dims 128 \
  --dtypes bf16 --impls ours jax-cudnn --target-ms 10 --reps 3 --max-seconds 45 --out "$out/fewq.json" 2>&1 | tail -4
el ncu
} > "$out/bench.log" 2>&1
cat "$out/bench.log"
sec="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis"
for c in "ours 4 4096 noncausal" "jax-cudnn 4 4096 noncausal" "ours 16 1024 causal" "jax-cudnn 16 1024 causal" "ours 4 4096 causal 64"; do
  set -- $c
  kn='regex:PrefillKernel'; [ "$1" = jax-cudnn ] && kn='regex:sdpa|fmha|flash'
  echo "=== $c" >> "$out/ncu.txt"
  timeout 100 ncu --clock-control none --target-processes all --kernel-name "$kn" --launch-skip 2 --launch-count 1 \
    $sec python3 tools/probes/prefill_ncu_case.py $c >> "$out/ncu.txt" 2>&1
  echo "exit $?" >> "$out/ncu.txt"
done
el done
grep -E "^===|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|No Eligible|Registers Per|Achieved Occupancy|Grid Size|exit" "$out/ncu.txt" | head -90
