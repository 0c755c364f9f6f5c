"""One decode-attention call shape, run a few times, for Nsight Compute (tools/probes/sessions/s24_a.sh):
    python tools/probes/decode_ncu_case.py IMPL [B CTX D]
IMPL "ours" (cuda.decode_attention with the JOA_DECODE_* defaults) or "cudnn"
(jax.nn.dot_product_attention, implementation="cudnn", static lengths: the bench's jax-cudnn peer).
fp16, 32 query / 8 KV heads, one query token, every cache row valid (the bench decode case); the
default shape is the ~8B decoder's B=8 step at capacity 2304 (bench e2e ctx 2k)."""

import math
import sys

import jax
import jax.numpy as jnp

from jax_onnx_attn.ops import cuda

impl = sys.argv[1]
b, c, d = (int(a) for a in sys.argv[2:5]) if len(sys.argv) > 4 else (8, 2304, 128)
hq, hkv = 32, 8
keys = jax.random.split(jax.random.PRNGKey(0), 3)
scale = 1.0 / math.sqrt(d)
if impl == "ours":
    q = jax.random.normal(keys[0], (b, hq, 1, d), jnp.float16)
    k = jax.random.normal(keys[1], (b, hkv, c, d), jnp.float16)
    v = jax.random.normal(keys[2], (b, hkv, c, d), jnp.float16)
    lens = jnp.full((b,), c, jnp.int32)
    fn = jax.jit(lambda q, k, v, lens: cuda.decode_attention(q, k, v, lens, scale=scale, causal=True))
    args = (q, k, v, lens)
    print(cuda.decode_plan(b, hq, hkv, 1, c, d))
else:
    q = jax.random.normal(keys[0], (b, 1, hq, d), jnp.float16)
    k = jax.random.normal(keys[1], (b, c, hkv, d), jnp.float16)
    v = jax.random.normal(keys[2], (b, c, hkv, d), jnp.float16)
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn"))
    args = (q, k, v)
for _ in range(4):
    y = fn(*args)
y.block_until_ready()
print("decode", impl, b, c, d, "ok")
