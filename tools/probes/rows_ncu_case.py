"""One int4 projection on the rows kernel (ffi/kernels/gemv/rows.cuh), run a few times, for Nsight
Compute (tools/probes/sessions/s21_rows2.sh):
    python tools/probes/rows_ncu_case.py K N M [CLUSTER WARPS_N DEPTH]
Weights of rows_kernel_times.rows_weights (block 32, zero points, fp16 x); zeros in the plan = the
planner's."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.ops import cuda_matmul
from rows_kernel_times import BLOCK, rows_weights  # this folder: on sys.path when run as a script

k, n, m = (int(a) for a in sys.argv[1:4])
c, w, d = (int(a) for a in sys.argv[4:7]) if len(sys.argv) > 6 else (0, 0, 0)
rng = np.random.default_rng(0)
packed = rows_weights(k, n, rng)
x = jnp.asarray(rng.standard_normal((m, k)), jnp.float16)
fn = jax.jit(lambda x, *p: cuda_matmul.matmul_nbits_rows(x, *p, n=n, block_size=BLOCK, cluster=c,
                                                          warps_n=w, depth=d))
print(cuda_matmul.gemv_plan(m, n, k, 4, False, c, block_size=BLOCK, rows_layout=True, warps_n=w, depth=d))
for _ in range(4):
    y = fn(x, *packed)
y.block_until_ready()
print("rows", k, n, m, c, w, d, "ok")
