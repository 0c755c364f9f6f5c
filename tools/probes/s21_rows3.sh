#!/usr/bin/env bash
# Session 21, the rows kernel with its W ring in shared memory: its GPU test file, then the device
# time per call over forced plans at the ~1B shapes (tools/probes/rows_kernel_times.py).
# To $OUT: prepare.log, tests.log, times.json, times.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
timeout 240 python3 -m pytest -m gpu -q -ra -n 8 --dist load -p no:cacheprovider tests/gpu/test_linear_rows_gpu.py \
  > "$out/tests.log" 2>&1; echo "tests exit $?" >> "$out/tests.log"
tail -25 "$out/tests.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 300 python3 tools/probes/rows_kernel_times.py "$out/times.json" > "$out/times.log" 2>&1; echo "times exit $?" >> "$out/times.log"
tail -3 "$out/times.log" | cut -c1-400
