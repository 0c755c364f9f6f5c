"""One int4 projection at M = 1 on the slots kernel's record reader (ffi/kernels/gemv/slots.cuh), run a
few times, for Nsight Compute (tools/probes/s22_a.sh):
    python tools/probes/record_ncu_case.py K N
Weights of record_kernel_times.record_weights (block 32, zero points, fp16 x)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.ops import cuda_matmul
from record_kernel_times import BLOCK, record_weights  # this folder: on sys.path when run as a script

k, n = (int(a) for a in sys.argv[1:3])
rng = np.random.default_rng(0)
rec = record_weights(k, n, rng)
x = jnp.asarray(rng.standard_normal((1, k)), jnp.float16)
fn = jax.jit(lambda x, r: cuda_matmul.matmul_nbits_record(x, r, n=n, block_size=BLOCK))
print(cuda_matmul.gemv_plan(1, n, k, 4, False, block_size=BLOCK, record_layout=True))
for _ in range(4):
    y = fn(x, rec)
y.block_until_ready()
print("record", k, n, "ok")
