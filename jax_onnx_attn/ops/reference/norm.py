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
    y = x.astype(acc) * inv_rms(x, epsilon, axis=axis)
    if weight is not None:
        y = y * jnp.asarray(weight).astype(acc)
    return y.astype(x.dtype)


def inv_rms(x, epsilon: float = 1e-6, *, axis: int | tuple[int, ...] = -1):
    """1 / sqrt(mean(x², axis) + epsilon): the statistic `rms_norm` scales by (ONNX's inv_std_var).

    Args:
      x: float array of any shape.
      epsilon: added to the mean square.
      axis: the axis or axes that are normalised together.

    Returns:
      x's shape with the normalised axes 1, in float32 (float64 for f64 x).
    """
    xf = x.astype(accumulation_dtype(x.dtype))
    ms = jnp.mean(jnp.square(xf), axis=axis, keepdims=True)
    return lax.rsqrt(ms + jnp.asarray(epsilon, xf.dtype))
