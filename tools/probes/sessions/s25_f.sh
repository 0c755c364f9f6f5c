#!/usr/bin/env bash
# Session 25, sixth call (~2 min): XLA's half GEMM at M 8 / 32 with the weight [N, K] (the loader's
# layout) against [K, N] (ONNX's): is the ~2-4% our fp16 B=8 steps' GEMMs lose to the peer's the layout?
# To $OUT: prepare.log, layout.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
timeout 150 python3 tools/probes/xla_weight_layout.py "$out/layout.json" 2>&1 | grep -v Warning | tail -22 | tee "$out/run.log"
