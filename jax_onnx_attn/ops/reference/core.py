"""Attention math shared by the reference implementations of both operators.

Layout is BHSD everywhere: q [B, Hq, S, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv]. Query head h uses
KV head h // (Hq // Hkv) (the interleaved mapping of ONNX Attention and GroupQueryAttention), which is
a reshape of Hq into (Hkv, G): no K/V is repeated. Products accumulate in float32 (float64 for f64).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def accumulation_dtype(dtype) -> jnp.dtype:
    """f64 stays f64; every other float type accumulates in f32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _group(q, hkv: int):
    b, hq, s, d = q.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    return q.reshape(b, hkv, hq // hkv, s, d)


def logits(q, k, scale, acc_dtype=None):
    """scale * q @ k^T per head -> [B, Hq, S, T] in the accumulation dtype."""
    acc = acc_dtype or accumulation_dtype(q.dtype)
    qg = _group(q, k.shape[1])
    x = jnp.einsum("bkgsd,bktd->bkgst", qg, k, preferred_element_type=acc,
                   precision=lax.Precision.HIGHEST)
    b, hkv, g, s, t = x.shape
    return (x * jnp.asarray(scale, acc)).reshape(b, hkv * g, s, t)


def key_window(pos, t: int, *, causal: bool, left: int = -1, right: int = -1):
    """Boolean [..., S, T]: keys j in [0, T) that the causal and window rules leave visible.

    pos: int32 [..., S, 1], the absolute position of each query row. Key j is visible when
    j <= pos (causal), pos - j <= left (left >= 0) and j - pos <= right (right >= 0).
    """
    j = jnp.arange(t, dtype=jnp.int32)
    ok = jnp.ones(jnp.broadcast_shapes(pos.shape, (t,)), jnp.bool_)
    if causal:
        ok = ok & (j <= pos)
    if left >= 0:
        ok = ok & (pos - j <= left)
    if right >= 0:
        ok = ok & (j - pos <= right)
    return ok


def apply_softcap(x, softcap: float):
    """softcap * tanh(x / softcap); softcap <= 0 (or None) means off.

    Args:
      x: float logits, any shape (here [B, Hq, S, T] in the accumulation dtype); the result keeps
        x's shape and dtype.
      softcap: the cap, a Python float.
    """
    if softcap is None or softcap <= 0:
        return x
    c = jnp.asarray(softcap, x.dtype)
    return c * jnp.tanh(x / c)


def softmax(x, sink=None):
    """Softmax over the last axis by the spec's math (ONNX's reference `_softmax`): a row with no
    visible key (all -inf) gives 0; NaN and +inf propagate as exp / sum make them (NaN rows).

    The NaN / Inf rule of both operators (docs/attention.md "NaN and Inf"): a row is *fully masked*
    when every logit is -inf (no visible key) and gives 0, never NaN; a row that is *poisoned* (a
    NaN logit, or a +inf one, from Q, K, a float mask or bias) gives NaN, never 0.

    `sink` (broadcastable to x[..., :1]) is an extra logit that enters the max and the denominator
    but has no value row (attention sinks / smooth softmax). Computed in x's dtype.
    """
    m = jnp.max(x, axis=-1, keepdims=True)          # NaN when the row holds a NaN
    if sink is not None:
        sink = jnp.asarray(sink, x.dtype)
        m = jnp.maximum(m, sink)
    # A row of -inf (no visible key) is shifted by 0, so exp() gives 0 there rather than NaN;
    # a NaN or +inf max is kept, so the row becomes NaN as the plain math makes it.
    m = jnp.where(jnp.isneginf(m), jnp.zeros_like(m), m)
    e = jnp.exp(x - lax.stop_gradient(m))
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink - m)
    return e / jnp.where(denom == 0, jnp.ones_like(denom), denom)


def weighted_values(p, v, acc_dtype=None):
    """p [B, Hq, S, T] @ v [B, Hkv, T, Dv] -> [B, Hq, S, Dv] in the accumulation dtype."""
    acc = acc_dtype or accumulation_dtype(v.dtype)
    b, hq, s, t = p.shape
    hkv = v.shape[1]
    pg = p.reshape(b, hkv, hq // hkv, s, t)
    y = jnp.einsum("bkgst,bktd->bkgsd", pg, v, preferred_element_type=acc,
                   precision=lax.Precision.HIGHEST)
    return y.reshape(b, hq, s, v.shape[-1])
