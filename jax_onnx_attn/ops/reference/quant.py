"""Symmetric int8 / int4 KV-cache quantisation, bit-exact with onnxruntime's GroupQueryAttention.

  quantize:   q = clamp(round_half_even(x · (1 / scale)), qmin, qmax)   int8 [-128, 127], int4 [-8, 7]
  dequantize: x = q · scale
A scale of 0 counts as 1. int4 packs two values a byte, column 2i in the low nibble and 2i+1 in the
high nibble, each stored with a +8 bias (uint8 [..., D/2]).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_onnx_attn.ops.reference.core import accumulation_dtype

#: bits -> (storage dtype, qmin, qmax)
FORMATS = {8: (jnp.dtype(jnp.int8), -128, 127), 4: (jnp.dtype(jnp.uint8), -8, 7)}


def storage_dtype(bits: int) -> jnp.dtype:
    """The cache element type of a bit width: int8 for 8, uint8 (two values a byte) for 4."""
    return FORMATS[bits][0]


def _scale(scale):
    s = jnp.asarray(scale, jnp.float32)
    return jnp.where(s == 0, jnp.ones_like(s), s)


def quantize(x, scale, bits: int):
    """x [..., D] float -> int8 [..., D] (bits=8) or uint8 [..., D/2] (bits=4).

    `scale` is float32 and broadcastable to x: one element (per tensor) or, for a [B, H, S, D]
    cache, [1, H, 1, D] (per channel). The multiplication by the reciprocal matches onnxruntime
    at the rounding ties (x / scale does not).
    """
    _, qmin, qmax = FORMATS[bits]
    # x·(1/s) in float32, as onnxruntime computes it, whatever x's dtype (f64 rounds first).
    q = jnp.clip(jnp.round(x.astype(jnp.float32) * (1.0 / _scale(scale))), qmin, qmax)
    q = q.astype(jnp.int32)
    if bits == 8:
        return q.astype(jnp.int8)
    biased = (q + 8).astype(jnp.uint8)
    return biased[..., 0::2] | (biased[..., 1::2] << 4)


def dequantize(q, scale, bits: int, dtype):
    """The inverse of `quantize`: int8 [..., D] or uint8 [..., D/2] -> dtype [..., D]."""
    if bits == 8:
        values = q.astype(jnp.int32)
    else:
        lo = (q & 15).astype(jnp.int32) - 8
        hi = (q >> 4).astype(jnp.int32) - 8
        values = jnp.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], 2 * q.shape[-1])
    acc = accumulation_dtype(dtype)
    return (values.astype(acc) * _scale(scale).astype(acc)).astype(dtype)
