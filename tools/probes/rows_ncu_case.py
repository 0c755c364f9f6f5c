"""One int4 projection on the rows kernel (ffi/kernels/gemv/rows.cuh), run a few times, for Nsight
Compute (tools/probes/s21_rows.sh):
    python tools/probes/rows_ncu_case.py K N M [CLUSTER WARPS_N DEPTH]
Weights as `bench linear --nbits-rows` makes them (block 32, zero points, fp16 x); zeros in the
plan = the planner's."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.ops import cuda_matmul
from jax_onnx_attn.ops.linear import to_rows_layout

k, n, m = (int(a) for a in sys.argv[1:4])
c, w, d = (int(a) for a in sys.argv[4:7]) if len(sys.argv) > 6 else (0, 0, 0)
block = 32
a, b, z = jax.random.split(jax.random.PRNGKey(0), 3)
bq = np.asarray(jax.random.randint(a, (n, k // block, block // 2), 0, 256, jnp.int32).astype(jnp.uint8))
s = np.asarray((jax.random.uniform(b, (n, k // block), jnp.float32, 0.5, 1.5) / 16).astype(jnp.float16))
zp = np.asarray(jax.random.randint(z, (n, k // block), 0, 16, jnp.int32).astype(jnp.uint8))
packed = tuple(jnp.asarray(t) for t in to_rows_layout(bq, s, zp))
x = jax.random.normal(a, (m, k), jnp.float16)
fn = jax.jit(lambda x, *p: cuda_matmul.matmul_nbits_rows(x, *p, n=n, block_size=block, cluster=c,
                                                          warps_n=w, depth=d))
print(cuda_matmul.gemv_plan(m, n, k, 4, False, c, block_size=block, rows_layout=True, warps_n=w, depth=d))
for _ in range(4):
    y = fn(x, *packed)
y.block_until_ready()
print("rows", k, n, m, c, w, d, "ok")
