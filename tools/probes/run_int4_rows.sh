#!/usr/bin/env bash
# On the device: the int4 multi-row GEMV probe (tools/probes/gemv_int4_rows.cu) over its knobs, into
# $OUT/int4_rows.txt. $1: the compiled binary. ~60-90 s on an H200: the first pass checks every
# shape / M / bs against the reference with the planned geometry; the others time variants on the
# ~8B shapes without the check (JOA_PROBE_CHECK=0), so one run compares stages in flight, the two
# scale modes and coarser / finer CTA geometry.
set -u
BIN=${1:?usage: run_int4_rows.sh path/to/gemv_int4_rows}
OUT=${OUT:-.}
LOG="$OUT/int4_rows.txt"
: >"$LOG"
run() {  # run <label> <env...>: one pass, 30 s at most
  echo "=== $*" >>"$LOG"
  env "${@:2}" timeout 30 "$BIN" >>"$LOG" 2>&1
  echo "=== rc $?" >>"$LOG"
}
run planned JOA_PROBE_8B=1
run ds2 JOA_PROBE_8B=2 JOA_PROBE_DS=2 JOA_PROBE_CHECK=0 JOA_PROBE_M=8
run mode-flip-a JOA_PROBE_8B=2 JOA_PROBE_MODE=1 JOA_PROBE_CHECK=0 JOA_PROBE_M=8
run mode-flip-acc JOA_PROBE_8B=2 JOA_PROBE_MODE=0 JOA_PROBE_CHECK=0 JOA_PROBE_M=32
run rw4 JOA_PROBE_8B=2 JOA_PROBE_RW=4 JOA_PROBE_CHECK=0 JOA_PROBE_M=8
run rw2 JOA_PROBE_8B=2 JOA_PROBE_RW=2 JOA_PROBE_CHECK=0 JOA_PROBE_M=8
run s16 JOA_PROBE_8B=2 JOA_PROBE_RW=8 JOA_PROBE_S=16 JOA_PROBE_CHECK=0 JOA_PROBE_BS=128
cat "$LOG"
