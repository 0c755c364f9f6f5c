"""One call of each GEMV engine target on an 8B-MLP-sized weight (K 4096, N 28672, M 1), for ncu:
    ncu --clock-control none -k regex:GemvKernel -c 2 --section WarpStateStats ... python3 gemv_one.py
"""
import sys

import jax
import jax.numpy as jnp

from jax_onnx_attn import ops
from jax_onnx_attn.ops import cuda_matmul

k, n, m = 4096, 28672, int(sys.argv[1]) if len(sys.argv) > 1 else 1
dt = jnp.float16
kx, kw = jax.random.split(jax.random.PRNGKey(0))
x = jax.random.normal(kx, (m, k), dt)
w = (jax.random.normal(kw, (n, k), jnp.float32) / 64).astype(dt)
bq = jax.random.randint(kw, (n, k // 32, 16), 0, 256, jnp.int32).astype(jnp.uint8)
s = ops.tile_nbits_meta(jnp.full((n, k // 32), 0.01, dt))  # the target's tiled layout
z = ops.tile_nbits_meta(jnp.full((n, k // 32), 8, jnp.uint8))
dense = jax.jit(cuda_matmul.linear)
nbits = jax.jit(lambda x, bq, s, z: cuda_matmul.matmul_nbits(x, bq, s, z, bits=4, block_size=32))
print(cuda_matmul.gemv_plan(m, n, k, 16, False), cuda_matmul.gemv_plan(m, n, k, 4, False))
for _ in range(2):
    dense(x, w).block_until_ready()
    nbits(x, bq, s, z).block_until_ready()
