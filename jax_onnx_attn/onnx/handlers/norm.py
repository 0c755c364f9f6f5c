"""Normalisations: RMSNormalization-23, LayerNormalization-17 and onnxruntime's (Skip)(Simplified)
LayerNormalization contrib ops. Statistics run in float32 (stash_type 1) and round once.

Handlers: `(ctx, *inputs) -> outputs`, per their @register op's ONNX schema (see `onnx.handlers`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_onnx_attn.onnx.registry import MS_DOMAIN, register
from jax_onnx_attn.onnx.values import to_jax
from jax_onnx_attn.ops.reference.core import accumulation_dtype
from jax_onnx_attn.ops.reference.norm import inv_rms, rms_norm


def _norm_axes(ctx, x) -> tuple[int, ...]:
    """Normalised axes: from `axis` (default -1) to the last, as every op here defines them."""
    axis = ctx.attr("axis", -1)
    axis = axis + x.ndim if axis < 0 else axis
    return tuple(range(axis, x.ndim))


@register("RMSNormalization", 23)
@register("SimplifiedLayerNormalization", 1)
def simplified_layer_norm(ctx, x, scale):
    """RMSNormalization-23 / onnxruntime SimplifiedLayerNormalization: x / rms(x) * scale.

    Args:
      x: float [..., H...]; normalised over the axes from attribute `axis` (default -1) to the last.
      scale: [H...] (the normalised axes' shape, broadcastable), float.

    Returns:
      Y of x's shape and dtype; with a second wanted output (SimplifiedLayerNormalization's
      inv_std_var) also that: float32 (float64 for f64 x), x's shape with the normalised axes 1.
    """
    x = to_jax(x)
    axes = _norm_axes(ctx, x)
    eps = ctx.attr("epsilon", 1e-5)
    y = rms_norm(x, to_jax(scale), eps, axis=axes)
    return (y, inv_rms(x, eps, axis=axes)) if ctx.wants(1) else y


@register("SkipSimplifiedLayerNormalization", 1, domain=MS_DOMAIN)
def skip_simplified_layer_norm(ctx, x, skip, gamma, bias=None):
    """s = x + skip (+ bias); outputs (rms_norm(s) * gamma, mean (unused: None), inv_std_var, s).

    Args:
      x, skip: float [B, S, H] (skip broadcastable to x); gamma: [H]; bias: [H] or None.

    Returns:
      (y [B, S, H] of x's dtype, None, inv_std_var float32 [B, S, 1] or None when not wanted,
      s [B, S, H] the input-plus-skip sum).
    """
    s = to_jax(x) + to_jax(skip)
    if bias is not None:
        s = s + to_jax(bias)
    eps = ctx.attr("epsilon", 1e-5)
    y = rms_norm(s, to_jax(gamma), eps, axis=-1)
    return y, None, inv_rms(s, eps, axis=-1) if ctx.wants(2) else None, s


def _layer_norm(x, scale, bias, axes, eps):
    """(y in x's dtype, mean, inv_std_dev); the statistics in float32 (float64 for f64 x)."""
    xf = x.astype(accumulation_dtype(x.dtype))
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    centred = xf - mean
    inv = inv_rms(centred, eps, axis=axes)
    y = centred * inv * scale.astype(centred.dtype)
    if bias is not None:
        y = y + bias.astype(centred.dtype)
    return y.astype(x.dtype), mean, inv


@register("LayerNormalization", 17)
def layer_norm(ctx, x, scale, bias=None):
    """LayerNormalization-17: (x - mean) / std * scale + bias; outputs (Y, Mean, InvStdDev)."""
    x = to_jax(x)
    axes = _norm_axes(ctx, x)
    y, mean, inv = _layer_norm(x, to_jax(scale), to_jax(bias), axes, ctx.attr("epsilon", 1e-5))
    return y, mean, inv


@register("SkipLayerNormalization", 1, domain=MS_DOMAIN)
def skip_layer_norm(ctx, x, skip, gamma, beta=None, bias=None):
    """com.microsoft SkipLayerNormalization: layer_norm(x + skip + bias); outputs (y, mean, inv, s)."""
    s = to_jax(x) + to_jax(skip)
    if bias is not None:
        s = s + to_jax(bias)
    y, mean, inv = _layer_norm(s, to_jax(gamma), to_jax(beta), (s.ndim - 1,),
                               ctx.attr("epsilon", 1e-5))
    return y, mean, inv, s
