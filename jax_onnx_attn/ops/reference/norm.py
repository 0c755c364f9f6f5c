"""RMS normalisation (T5 / Llama "RMSNorm"; ONNX RMSNormalization, SimplifiedLayerNormalization, and
GroupQueryAttention's per-head q/k norm)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_onnx_attn.ops.reference.core import accumulation_dtype


def rms_norm(x, weight=None, epsilon: float = 1e-6, *, axis: int | tuple[int, ...] = -1):
    """x / sqrt(mean(x², axis) + epsilon) * weight.

    Args:
      x: float array of any shape.
      weight: scale broadcastable to the normalised axes (e.g. [D] for axis=-1), or None.
      epsilon: added to the mean square.
      axis: the axis or axes that are normalised together.

    Returns:
      x's shape and dtype; the statistics and the product run in float32 (float64 for f64).
    """
    acc = accumulation_dtype(x.dtype)
    xf = x.astype(acc)
    ms = jnp.mean(jnp.square(xf), axis=axis, keepdims=True)
    y = xf * lax.rsqrt(ms + jnp.asarray(epsilon, acc))
    if weight is not None:
        y = y * jnp.asarray(weight).astype(acc)
    return y.astype(x.dtype)
