#!/usr/bin/env bash
# Run on the GPU machine (no network): the GPU tests on the carried snapshot (tools/snapshot.sh),
# with its prebuilt extension or built there. Usage: bash tools/device_gpu_tests.sh [pytest args...];
# logs go to $OUT when it is set.
set -uo pipefail
source "$(dirname "$0")/device_prepare.sh"
python3 -m pytest -m gpu -q -ra -n 0 -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_tests.log"
