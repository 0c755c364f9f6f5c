#!/usr/bin/env bash
# Session 32, call C (~1 min): the CUDA graph XLA instantiates for `jax-onnx-attn demo` on a 2-layer
# f16 decoder (hidden 1024, 8/2 heads: head dim 128): a decode step's command buffer
# (tools/probes/graph_dump: an LD_PRELOAD shim dumping each graph as DOT before cuGraphInstantiate;
# carry .snap with libgraph_dump.so, built here). The call as run also tried a chain of 4 decode
# calls, which made no graph (below XLA's minimum graph size, 5): s32_d.sh dumps a chain of 8.
# To $OUT: prepare.log, graphs.tar.xz, run.log.
set -uo pipefail
shim=/tmp/libgraph_dump.so
cp .snap/libgraph_dump.so $shim
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
mkdir -p /tmp/graphs/demo
el demo
JOA_GRAPH_DUMP=/tmp/graphs/demo JOA_GRAPH_DUMP_VERBOSE=1 JOA_GRAPH_DUMP_MAX=24 LD_PRELOAD=$shim timeout 120 \
  python3 -m jax_onnx_attn demo --layers 2 --hidden 1024 --heads 8 --kv-heads 2 --dtype float16 \
  --max-new-tokens 16 2>&1 | grep -v Warn | tail -14
ls -la /tmp/graphs/*
tar -C /tmp -cJf "$out/graphs.tar.xz" graphs
el done
} 2>&1 | tee "$out/run.log"
