"""Session 18: is `from_record_layout` (the record layout's XLA-side unpack, which the reference and
prompts use) wrong on the GPU? Session 17's loop diagnostic found the slots kernel (= record kernel)
0.4-0.75 of the output's max away from the reference computed through it, while on raw weights the
slots kernel and the reference agree (gated_diag.py) and on the CPU the unpack is exact. Checks, on
the GPU: the unpack's three outputs against NumPy's, bit for bit (eager and jitted), then the
reference through the record layout (a closed-over constant, as the loop diagnostic had it, and an
argument) against the reference on the raw weights, per variant."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn import ops
from jax_onnx_attn.ops.linear import from_record_layout

print(jax.devices())
for k, n, block, zp in [*itertools.product((2048,), (8192,), (32, 128), (False, True)), (4096, 2048, 128, True)]:
    rng = np.random.default_rng(k + n + block)
    bq = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
    s = (rng.uniform(0.5, 1.5, (n, k // block)) / (4 * k ** 0.5)).astype(jnp.bfloat16)
    z = rng.integers(0, 16, (n, k // block), dtype=np.uint8) if zp else None
    rec = ops.to_record_layout(bq, s, z)
    want = from_record_layout(rec, n=n, block_size=block, dtype=jnp.bfloat16)
    line = f"K={k} N={n} block={block} zp={zp}:"
    for how, fn in (("eager", lambda r: from_record_layout(r, n=n, block_size=block, dtype=jnp.bfloat16)),
                    ("jit", jax.jit(lambda r: from_record_layout(r, n=n, block_size=block, dtype=jnp.bfloat16)))):
        got = fn(jnp.asarray(rec))
        eq = [np.array_equal(np.ascontiguousarray(g).view(np.uint8), np.ascontiguousarray(w).view(np.uint8)) for g, w in zip(got, want)]
        bad = [int(np.sum(np.ascontiguousarray(g).view(np.uint8) != np.ascontiguousarray(w).view(np.uint8))) for g, w in zip(got, want)]
        line += f" {how} bq/s/zp equal {eq} (bytes off {bad})"
    x = jnp.asarray(rng.normal(size=(1, k)), jnp.bfloat16)
    raw = (jnp.asarray(bq), jnp.asarray(ops.tile_nbits_meta(s)), None if z is None else jnp.asarray(ops.tile_nbits_meta(z)))
    for gated, norm in ((False, False), (True, False), (True, True)):
        kw = dict(k=k, n=n, bits=4, block_size=block, gated=gated)
        if norm:
            kw["norm_weight"] = jnp.ones((k,), jnp.bfloat16)
        a = jax.jit(lambda x: ops.matmul_nbits(x, jnp.asarray(rec), None, backend="reference", layout="record", **kw))(x)
        b = jax.jit(lambda x: ops.matmul_nbits(x, *raw, backend="reference", wide=True, **kw))(x)
        c = jax.jit(lambda x, r: ops.matmul_nbits(x, r, None, backend="reference", layout="record", **kw))(x, jnp.asarray(rec))
        a, b, c = (np.asarray(t, np.float32) for t in (a, b, c))
        line += (f" | ref rec-vs-raw gated={gated} norm={norm}: {np.abs(a - b).max() / np.abs(b).max():.3g}"
                 f" (rec as an argument: {np.abs(c - b).max() / np.abs(b).max():.3g})")
    print(line, flush=True)
