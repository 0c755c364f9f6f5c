#!/usr/bin/env bash
# On the device: the int4 multi-row GEMV probe (tools/probes/gemv_int4_rows.cu: the engine's rows
# kernel) over its knobs, into $OUT/int4_rows.txt. $1: the compiled binary (build/gemv_int4_rows).
# ~60 s on an H200: the first two passes check every output against the reference (the planned
# geometry on all shapes, then 4 warps x 8 K splits on the ~8B ones); the others time variants on the
# ~8B shapes without the check (2 stages in flight, 8 warps x 16 splits), each pass 30 s at most.
set -u
BIN=${1:?usage: run_int4_rows.sh path/to/gemv_int4_rows}
OUT=${OUT:-.}
LOG="$OUT/int4_rows.txt"
: >"$LOG"
run() {  # run <label> <env...>
  echo "=== $*" >>"$LOG"
  env "${@:2}" timeout 30 "$BIN" >>"$LOG" 2>&1
  echo "=== rc $?" >>"$LOG"
}
run planned JOA_PROBE_8B=1
run rw4-s8 JOA_PROBE_8B=2 JOA_PROBE_RW=4 JOA_PROBE_S=8
run ds2 JOA_PROBE_8B=2 JOA_PROBE_DS=2 JOA_PROBE_CHECK=0
run rw8-s16 JOA_PROBE_8B=2 JOA_PROBE_RW=8 JOA_PROBE_S=16 JOA_PROBE_CHECK=0 JOA_PROBE_M=8
cat "$LOG"
