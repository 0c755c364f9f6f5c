#!/usr/bin/env bash
# Session 32, call D (~1.5 min): the one-split decode launches' timeline, raw graph vs XLA, in one
# profiled process (tools/probes/decode_gap_timeline.py; its library decode_raw_on_jax.so as in
# s32_xla_gap.sh), then the graph XLA builds for 8 such calls (graph_dump shim, as s32_c.sh).
# To $OUT: prepare.log, gap_timeline.json, graphs.tar.xz, run.log.
set -uo pipefail
lib=/tmp/decode_raw_on_jax.so
xz -d -c .snap/decode_raw_on_jax.so.xz > $lib
cp .snap/libgraph_dump.so /tmp/libgraph_dump.so
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el timeline
(cd tools/probes && timeout 150 python3 decode_gap_timeline.py $lib "$out/gap_timeline.json" 2304 4096 8192) 2>&1 | \
  grep -v Warn | tail -5
cat > /tmp/chain8.py <<'PY'
import jax, jax.numpy as jnp
from jax_onnx_attn.ops import cuda
c = 2304
q = jnp.zeros((1, 32, 1, 128), jnp.bfloat16)
ks = [jnp.ones((1, 8, c, 128), jnp.bfloat16) * i for i in range(8)]
lens = jnp.full((1,), c, jnp.int32)
def chain(q, ks):
    for i in range(8):
        q = cuda.decode_attention(q, ks[i], ks[i], lens, scale=0.088, engine="decode", split_rows=c)
    return q
f = jax.jit(chain, donate_argnums=0)
for _ in range(3):
    q = f(q, ks)
print(q.block_until_ready().shape)
PY
el graph
mkdir -p /tmp/graphs
JOA_GRAPH_DUMP=/tmp/graphs JOA_GRAPH_DUMP_VERBOSE=1 LD_PRELOAD=/tmp/libgraph_dump.so timeout 60 python3 /tmp/chain8.py 2>&1 | \
  grep -v Warn | tail -4
tar -C /tmp -cJf "$out/graphs.tar.xz" graphs
el done
} 2>&1 | tee "$out/run.log"
