#!/usr/bin/env bash
# Session 32, call B (~2 min): ncu's full section set of the one-split B=1 decode launch (bf16
# 32/8 d128, 2304 rows) as a raw CUDA graph and through XLA's command buffer, in one process each on
# jax's buffers (tools/probes/decode_ncu_pair.py; its library as in s32_xla_gap.sh). To $OUT:
# prepare.log, ncu_{raw,xla}.csv (raw page: every metric), ncu_{raw,xla}.txt (details), run.log.
set -uo pipefail
lib=/tmp/decode_raw_on_jax.so
xz -d -c .snap/decode_raw_on_jax.so.xz > $lib
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
NCU=/usr/local/cuda/bin/ncu
{
cd tools/probes
for mode in raw xla; do
  el "$mode"
  timeout 200 $NCU --set full --clock-control none -k regex:DecodeSplit --launch-skip 40 --launch-count 1 \
    --page raw --csv python3 decode_ncu_pair.py $lib $mode > "$out/ncu_$mode.csv" 2> /tmp/ncu_$mode.err
  echo "rc $?"; tail -3 /tmp/ncu_$mode.err; grep -c , "$out/ncu_$mode.csv"
  timeout 150 $NCU --set full --clock-control none -k regex:DecodeSplit --launch-skip 40 --launch-count 1 \
    python3 decode_ncu_pair.py $lib $mode > "$out/ncu_$mode.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Elapsed Cycles|SM Frequency" "$out/ncu_$mode.txt" | head -6
done
el done
} 2>&1 | tee "$out/run.log"
