#!/usr/bin/env bash
# The first device call session 17 leaves (~8 min), in priority order, outputs straight to $OUT:
# 1) the open gated question: slots / ring / reference on raw tiled 4-bit weights (gated_diag.py),
#    then the record loop's per-op errors (record_loop_diag.py);
# 2) the record layout's GPU file in full (three tests fixed without a GPU run) and the slots tests;
# 3) issue 12's grid at the landed commit (tools/device_e2e_grid.sh with smaller budgets: tuned
#    prefill default, int4 B=1 on the record layout).
# Build and carry the snapshot first (tools/build_device_ext.sh; tools/snapshot.sh --so <.so>;
# carry ".snap"), then from the repo root: bash .snap/tools/probes/sessions/pending_gpu_s17.sh
# To $OUT: prepare.log, gated.txt, tests.log, e2e_8b.json, e2e_1b.json, e2e_grid.txt.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el "gated diagnostics"
{ timeout 100 python3 tools/probes/gated_diag.py; timeout 60 python3 tools/probes/record_loop_diag.py; } 2>&1 \
  | grep -v Warning | tee "$out/gated.txt" | tail -30
el "record + slots GPU tests"
timeout 150 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider \
  tests/gpu/test_linear_record_gpu.py tests/gpu/test_linear_gpu.py -k "record or slots" > "$out/tests.log" 2>&1
tail -6 "$out/tests.log"
el "issue 12 grid (tools/device_e2e_grid.sh, trimmed to the call)"
E2E_8B_S=${E2E_8B_S:-170} E2E_1B_S=${E2E_1B_S:-100} bash tools/device_e2e_grid.sh | tail -40
el done
