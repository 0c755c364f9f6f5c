#!/usr/bin/env bash
# Prepared in session 32 for the next one (not yet run): issue 15's "no regression elsewhere in the
# grid" as one in-process-per-tree A/B on the H200: the decode engine at bc0d36c (the commit issue 15
# was measured at) against this tree, the same grid, back to back in one call (~8 min).
# Here: bash tools/snapshot.sh --so <the device .so>; git archive bc0d36c | xz -T2 -6 > .snap/base.tar.xz
# (~1.4 MB); carry .snap. There: bc0d36c built into a wheel for sm_90a (16 cores, ~2-3 min), then
# bench decode (bf16 32/8, d64 / d128, B 1 / 2 / 4 / 8 / 32, ctx 1k / 4k / 16k, q_len 1) with the base
# (ours), this tree (ours --device-time) and the base again, so drift between the runs shows.
# To $OUT: prepare.log, base_build.log, base_1.json, head.json, base_2.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
GRID="--batch 1 2 4 8 32 --ctx 1024 4096 16384 --qlen 1 --heads 32/8 --dims 64 128 --dtypes bf16 --target-ms 10 --reps 3"
{
el "build bc0d36c"
rm -rf /tmp/base /tmp/base_wheel /tmp/base_inst && mkdir -p /tmp/base && tar -xJf /tmp/joa/base.tar.xz -C /tmp/base
(cd /tmp/base && python3 -m pip wheel -q --no-build-isolation --no-deps -w /tmp/base_wheel . -Cbuild-dir=/tmp/base-build \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real) > "$out/base_build.log" 2>&1 || { tail -20 "$out/base_build.log"; exit 1; }
(cd /tmp/base_wheel && python3 -m zipfile -e *.whl /tmp/base_inst)
# From /tmp, so that neither tree's folder shadows the package on sys.path.
base() {
  (cd /tmp && PYTHONPATH=/tmp/base_inst JOA_GIT_COMMIT=bc0d36c timeout 170 python3 -m jax_onnx_attn.bench decode $GRID \
    --impls ours --max-seconds 150 --out "$out/base_$1.json" 2>&1 | grep -E "^B=" | tail -32)
}
el "base, first"; base 1
el "this tree"
(cd /tmp && PYTHONPATH=/tmp/joa timeout 200 python3 -m jax_onnx_attn.bench decode $GRID --impls ours --device-time \
  --max-seconds 180 --out "$out/head.json" 2>&1 | grep -E "^B=" | tail -32)
el "base, again"; base 2
el done
} 2>&1 | tee "$out/run.log"
