#!/usr/bin/env bash
# Session 32, calls G-H (~1 min): does XLA re-record our custom calls on every run? The graph_dump
# shim counting driver calls (JOA_GRAPH_COUNT=1: graph instantiations, stream captures = custom
# calls traced, exec-graph and child-node updates, graph launches) around 1) a B=1 chain like bench
# decode's (32 dependent calls, 16 K / V copies, q donated; planned and one split), 3 runs each,
# and 2) `jax-onnx-attn demo` decoding 8 and 72 tokens (`s32_g.sh chain`: only 1). What it found:
# the chains ran without command buffers (decode_xla_chain.py then imported rows_kernel_times.py,
# whose import turns them off; fixed: probe_results.py); the demo instantiates one graph and
# launches it once a step, no re-record. To $OUT: prepare.log, run.log.
set -uo pipefail
cp .snap/libgraph_dump.so /tmp/libgraph_dump.so
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
cat > /tmp/chain32.py <<'PY'
import sys
import jax, jax.numpy as jnp
sys.path.insert(0, "tools/probes")
from decode_xla_chain import inputs
from jax_onnx_attn.ops import cuda
q, ks, vs, lens = inputs(4096, seed=0)
def chain(q, ks, vs):
    for i in range(32):
        q = cuda.decode_attention(q, ks[i % 16], vs[i % 16], lens, scale=0.088, causal=True)
    return q
f = jax.jit(chain, donate_argnums=0)
runs = int(sys.argv[1])
if len(sys.argv) > 2:  # one split a call, the decode engine named (s32_d.sh's chain8 form)
    def chain(q, ks, vs):
        for i in range(32):
            q = cuda.decode_attention(q, ks[i % 16], vs[i % 16], lens, scale=0.088, engine="decode", split_rows=4096)
        return q
    f = jax.jit(chain, donate_argnums=0)
for _ in range(runs):
    q = f(q, ks, vs)
q.block_until_ready()
print("runs", runs, flush=True)
PY
for mode in "" one; do
  el "chain x3 ${mode:-planned}"
  JOA_GRAPH_COUNT=1 LD_PRELOAD=/tmp/libgraph_dump.so timeout 60 python3 /tmp/chain32.py 3 $mode 2>&1 | grep -E "runs|graph_dump"
done
[ "${1:-}" = chain ] && exit 0
for n in 8 72; do
  el "demo $n tokens"
  JOA_GRAPH_COUNT=1 LD_PRELOAD=/tmp/libgraph_dump.so timeout 90 python3 -m jax_onnx_attn demo --layers 2 --hidden 1024 \
    --heads 8 --kv-heads 2 --dtype float16 --max-new-tokens $n 2>&1 | grep -E "decode:|graph_dump\] cu"
done
el done
} 2>&1 | tee "$out/run.log"
