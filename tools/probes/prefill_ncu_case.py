"""One prefill-attention shape, run a few times, for Nsight Compute (tools/probes/sessions/issue14_close.sh):
    python tools/probes/prefill_ncu_case.py IMPL B S CAUSAL [D]
IMPL: ours (cuda.prefill_attention, the head size's default schedule) or jax-cudnn
(jax.nn.dot_product_attention, implementation="cudnn"); bf16, 32/8 heads, D 128 by default."""

import math
import sys

import jax
import jax.numpy as jnp

impl, b, s, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "causal"
d = int(sys.argv[5]) if len(sys.argv) > 5 else 128
hq, hkv = 32, 8
keys = jax.random.split(jax.random.PRNGKey(0), 3)
q = jax.random.normal(keys[0], (b, hq, s, d), jnp.bfloat16)
k = jax.random.normal(keys[1], (b, hkv, s, d), jnp.bfloat16)
v = jax.random.normal(keys[2], (b, hkv, s, d), jnp.bfloat16)
lens = jnp.full((b,), s, jnp.int32)
if impl == "ours":
    from jax_onnx_attn.ops import cuda
    fn = jax.jit(lambda q, k, v: cuda.prefill_attention(q, k, v, lens, lens, scale=1 / math.sqrt(d), causal=causal))
else:
    t = lambda x: x.transpose(0, 2, 1, 3)  # BSHD
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal,
                                                              implementation="cudnn"))
for _ in range(4):
    y = fn(q, k, v)
y.block_until_ready()
print(impl, b, s, "causal" if causal else "noncausal", d, "ok")
