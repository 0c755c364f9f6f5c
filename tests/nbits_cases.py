"""Random 4-bit MatMulNBits operands and fusion operands shared by the layout tests (rows, record),
CPU and GPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def nbits_weights(n, k, block, zp, seed=0, dtype=np.float16):
    """prepare_nbits' form: b_quant [n, kb, block / 2], scales [n, kb] ~ 1 / (4 sqrt(K)), zero points
    [n, kb] or None."""
    rng = np.random.default_rng(seed + n + k + block)
    kb = k // block
    b_quant = rng.integers(0, 256, (n, kb, block // 2), dtype=np.uint8)
    scales = (rng.uniform(0.5, 1.5, (n, kb)) / (16 * np.sqrt(k) / 4)).astype(dtype)
    zeros = rng.integers(0, 16, (n, kb), dtype=np.uint8) if zp else None
    return b_quant, scales, zeros


def fusion_operands(fusion, k, n, m, dtype, seed=0):
    """(static arguments, operands) of a fusion name ("plain", "bias", "residual", "norm", "gated",
    "gated_bias", "norm_gated", "all") for m rows of x (gated: the weight's rows are gate / up pairs)."""
    rng = np.random.default_rng(seed + m)
    gated = "gated" in fusion or fusion == "all"
    n_out = n // 2 if gated else n
    static, arrays = {"gated": gated}, {}
    if "bias" in fusion or fusion == "all":
        arrays["bias"] = jnp.asarray(rng.normal(size=n), dtype)
    if fusion in ("residual", "all"):
        arrays["residual"] = jnp.asarray(rng.normal(size=(m, n_out)), dtype)
    if "norm" in fusion or fusion == "all":
        arrays["norm_weight"] = jnp.asarray(1 + 0.1 * rng.normal(size=k), dtype)
        static["norm_epsilon"] = 1e-5
    return static, arrays
