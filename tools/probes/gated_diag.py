"""Session 17: which of the slots kernel / ring kernel / reference disagree on gated 4-bit GEMVs at M = 1
(the record layout's loop test found slots == record != reference on a K 2048, block 128, norm,
zero-point gate-up). One op per config; relative errors against the reference."""
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn import ops


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


for k, block, zp, norm, gated in itertools.product((2048, 4096), (32, 128), (False, True), (False, True), (True, False)):
    if not gated and (norm or zp):
        continue
    n = 8192
    rng = np.random.default_rng(k + block)
    bq = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
    s = (rng.uniform(0.5, 1.5, (n, k // block)) / (4 * k ** 0.5)).astype(jnp.bfloat16)
    z = rng.integers(0, 16, (n, k // block), dtype=np.uint8) if zp else None
    x = jnp.asarray(rng.normal(size=(1, k)), jnp.bfloat16)
    w = (jnp.asarray(bq), jnp.asarray(ops.tile_nbits_meta(s)), None if z is None else jnp.asarray(ops.tile_nbits_meta(z)))
    kw = dict(k=k, n=n, bits=4, block_size=block, gated=gated)
    if norm:
        kw["norm_weight"] = jnp.ones((k,), jnp.bfloat16)
    out = {}
    for name, env in (("slots", "1"), ("ring", "0")):
        os.environ["JOA_GEMV_SLOTS"] = env
        out[name] = np.asarray(jax.jit(lambda x: ops.matmul_nbits(x, *w, backend="cuda", wide=True, **kw))(x))
    out["ref"] = np.asarray(jax.jit(lambda x: ops.matmul_nbits(x, *w, backend="reference", **kw))(x))
    print(f"K={k} block={block} zp={zp} norm={norm} gated={gated}: slots {rel(out['slots'], out['ref']):.3g} "
          f"ring {rel(out['ring'], out['ref']):.3g} slots-ring {rel(out['slots'], out['ring']):.3g}", flush=True)
