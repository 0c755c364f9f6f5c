#!/usr/bin/env bash
# Session 32, call C (~1.5 min): the CUDA graphs XLA instantiates (tools/probes/graph_dump: an
# LD_PRELOAD shim dumping each graph as DOT before cuGraphInstantiate), for 1) a jitted chain of 4
# one-split B=1 decode calls (the one whose calls run 2-4 us slower than the same launches in a raw
# graph: s32_xla_gap.sh) and 2) `jax-onnx-attn demo` on a 2-layer f16 decoder (hidden 1024, 8/2
# heads: head dim 128), a decode step's graph. Carry .snap with libgraph_dump.so (built here).
# To $OUT: prepare.log, graphs.tar.xz, run.log.
set -uo pipefail
shim=/tmp/libgraph_dump.so
cp .snap/libgraph_dump.so $shim
source "$(dirname "$0")/../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
mkdir -p /tmp/graphs/chain /tmp/graphs/demo
cat > /tmp/chain4.py <<'PY'
import jax, jax.numpy as jnp
from jax_onnx_attn.ops import cuda
c = 2304
q = jnp.zeros((1, 32, 1, 128), jnp.bfloat16)
ks = [jnp.ones((1, 8, c, 128), jnp.bfloat16) * i for i in range(4)]
lens = jnp.full((1,), c, jnp.int32)
def chain(q, ks):
    for i in range(4):
        q = cuda.decode_attention(q, ks[i], ks[i], lens, scale=0.088, engine="decode", split_rows=c)
    return q
f = jax.jit(chain, donate_argnums=0)
for _ in range(3):
    q = f(q, ks)
print(q.block_until_ready().shape)
PY
el chain
JOA_GRAPH_DUMP=/tmp/graphs/chain JOA_GRAPH_DUMP_VERBOSE=1 LD_PRELOAD=$shim timeout 60 python3 /tmp/chain4.py 2>&1 | \
  grep -v Warn | tail -8
el demo
JOA_GRAPH_DUMP=/tmp/graphs/demo JOA_GRAPH_DUMP_VERBOSE=1 JOA_GRAPH_DUMP_MAX=24 LD_PRELOAD=$shim timeout 120 \
  python3 -m jax_onnx_attn demo --layers 2 --hidden 1024 --heads 8 --kv-heads 2 --dtype float16 \
  --max-new-tokens 16 2>&1 | grep -v Warn | tail -14
ls -la /tmp/graphs/*
tar -C /tmp -cJf "$out/graphs.tar.xz" graphs
el done
} 2>&1 | tee "$out/run.log"
