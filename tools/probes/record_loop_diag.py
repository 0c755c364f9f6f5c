"""Why the record layout's decode-loop test disagreed with the reference (session 17): per-op errors
on the loop's own weights (record kernel vs reference vs the slots kernel on the same weights), then
the jitted loop with and without command buffers (argv[1] == "loop")."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn import ops

k, i, block = 2048, 4096, 128
rng = np.random.default_rng(0)
raw = {}


def weights(n, kk):
    bq = rng.integers(0, 256, (n, kk // block, block // 2), dtype=np.uint8)
    s = (rng.uniform(0.5, 1.5, (n, kk // block)) / (4 * kk ** 0.5)).astype(jnp.bfloat16)
    z = rng.integers(0, 16, (n, kk // block), dtype=np.uint8)
    raw[n] = (jnp.asarray(bq), jnp.asarray(ops.tile_nbits_meta(s)), jnp.asarray(ops.tile_nbits_meta(z)))
    return jnp.asarray(ops.to_record_layout(bq, s, z))


up, down = weights(2 * i, k), weights(k, i)
gamma = jnp.ones((k,), jnp.bfloat16)
x0 = jnp.asarray(rng.normal(size=(1, k)), jnp.bfloat16)


def gate_up(x, how):
    kw = dict(k=k, n=2 * i, bits=4, block_size=block, norm_weight=gamma, gated=True)
    if how == "record":
        return ops.matmul_nbits(x, up, None, backend="cuda", layout="record", **kw)
    return ops.matmul_nbits(x, *raw[2 * i], backend=how, wide=True, **kw) if how == "cuda" else \
        ops.matmul_nbits(x, up, None, backend="reference", layout="record", **kw)


def down_p(h, x, how):
    kw = dict(k=i, n=k, bits=4, block_size=block, residual=x)
    if how == "record":
        return ops.matmul_nbits(h, down, None, backend="cuda", layout="record", **kw)
    return ops.matmul_nbits(h, *raw[k], backend=how, wide=True, **kw) if how == "cuda" else \
        ops.matmul_nbits(h, down, None, backend="reference", layout="record", **kw)


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


if len(sys.argv) > 1 and sys.argv[1] == "loop":
    def steps(x, how):
        def body(_, x):
            return down_p(gate_up(x, how), x, how)
        return jax.lax.fori_loop(0, 8, body, x)
    out = {h: np.asarray(jax.jit(lambda x: steps(x, h))(x0), np.float32) for h in ("record", "cuda", "reference")}
    print(os.environ.get("XLA_FLAGS", ""), "loop rel err: record", rel(out["record"], out["reference"]),
          "slots", rel(out["cuda"], out["reference"]), "record vs slots", rel(out["record"], out["cuda"]),
          "max", float(np.abs(out["reference"]).max()))
    sys.exit(0)

x = x0
for step in range(8):
    hs = {h: jax.jit(lambda x, h=h: gate_up(x, h))(x) for h in ("record", "cuda", "reference")}
    ys = {h: jax.jit(lambda a, x, h=h: down_p(a, x, h))(hs["reference"], x) for h in ("record", "cuda", "reference")}
    print(f"step {step}: gate_up rel err record {rel(hs['record'], hs['reference']):.3g} slots "
          f"{rel(hs['cuda'], hs['reference']):.3g} rec==slots {np.array_equal(np.asarray(hs['record']), np.asarray(hs['cuda']))}; "
          f"down record {rel(ys['record'], ys['reference']):.3g} slots {rel(ys['cuda'], ys['reference']):.3g} "
          f"rec==slots {np.array_equal(np.asarray(ys['record']), np.asarray(ys['cuda']))}; |y| {float(np.abs(np.asarray(ys['reference'], np.float32)).max()):.3g}")
    x = ys["reference"]
