# Session 31: ncu on one decode launch in the raw graph and in XLA (run from the repository root with .snap and the probe binary carried).
set -uo pipefail
out=${OUT:-/tmp}
xz -d -c .snap/decode_last_cta.xz > /tmp/decode_last_cta && chmod +x /tmp/decode_last_cta
source .snap/tools/device_prepare.sh > /dev/null 2>&1 || true
cd /tmp/joa
M="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_elapsed.avg.per_second,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active"
echo "== raw one-split 2304 (the first shape)"
timeout 120 ncu --clock-control none --metrics $M --kernel-name regex:DecodeSplit --launch-skip 700 --launch-count 2 /tmp/decode_last_cta one-split 2>&1 | grep -E "DecodeSplit|duration|throughput|per_second|hit_rate|bytes_read|grid_size|warps_active" | head -16
cat > /tmp/one.py <<'PY'
import jax, jax.numpy as jnp, numpy as np
from jax_onnx_attn.ops import cuda
c = 2304
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((1, 32, 1, 128)), jnp.bfloat16)
ks = [jnp.asarray(rng.standard_normal((1, 8, c, 128)), jnp.bfloat16) for _ in range(16)]
vs = [jnp.asarray(rng.standard_normal((1, 8, c, 128)), jnp.bfloat16) for _ in range(16)]
lens = jnp.full((1,), c, jnp.int32)
def chain(q, ks, vs, lens):
    for i in range(32):
        q = cuda.decode_attention(q, ks[i % 16], vs[i % 16], lens, scale=0.088, engine="decode", split_rows=c)
    return q
f = jax.jit(chain, donate_argnums=0)
for _ in range(4):
    q = f(q, ks, vs, lens)
q.block_until_ready()
PY
echo "== XLA one-split 2304 (command buffers as the bench has them)"
timeout 150 ncu --clock-control none --metrics $M --kernel-name regex:DecodeSplit --launch-skip 40 --launch-count 2 python3 /tmp/one.py 2>&1 | grep -E "DecodeSplit|duration|throughput|per_second|hit_rate|bytes_read|grid_size|warps_active" | head -16
