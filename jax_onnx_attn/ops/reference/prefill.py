"""Reference prefill attention with ragged query and key lengths: the spec of the CUDA prefill
engine (ffi/kernels/prefill/, target prefill_attention).

q [B, Hq, S, D], k / v [B, Hkv, T, D], q_len / kv_len int [B] (clamped to [0, S] / [0, T]). Query
row i < q_len[b] sits at position pos_i = kv_len[b] - q_len[b] + i (bottom-right aligned) and sees
keys j < kv_len[b] and, causal, j <= pos_i; with local windows (left / right >= 0; -1 unbounded)
only keys with pos_i - j <= left and j - pos_i <= right (the decode spec's rule). sink: None or
[Hq], a per-query-head extra logit in the softmax's max and denominator without a value row
(attention sinks; GQA's head_sink, smooth_softmax = a sink of 0; the decode spec's `sink`).
softcap > 0: x -> softcap * tanh(x / softcap) before the mask (<= 0: off). Rows i >= q_len[b] and rows with no visible key give 0.
Keys at or past kv_len[b] may hold anything (NaN included): they are never read.

    x = scale * q @ k^T  ->  softcap  ->  hidden keys -inf  ->  softmax (with the sink)  ->  p (in q's dtype) @ v
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_onnx_attn.ops.reference import core


def prefill_attention(q, k, v, q_len, kv_len, sink=None, *, scale: float, causal: bool,
                      softcap: float = 0.0, left: int = -1, right: int = -1):
    """q [B, Hq, S, D], k / v [B, Hkv, T, D] (q's dtype), q_len / kv_len int [B] -> [B, Hq, S, D]."""
    s, t = q.shape[2], k.shape[2]
    acc = core.accumulation_dtype(q.dtype)
    q_len = jnp.clip(q_len.astype(jnp.int32), 0, s)[:, None, None, None]
    kv_len = jnp.clip(kv_len.astype(jnp.int32), 0, t)[:, None, None, None]
    i = jnp.arange(s, dtype=jnp.int32)[None, None, :, None]
    ok = core.key_window(kv_len - q_len + i, t, causal=causal, left=left, right=right)
    ok = ok & (jnp.arange(t, dtype=jnp.int32) < kv_len)
    valid_key = jnp.arange(t)[None, None, :, None] < kv_len  # [B, 1, T, 1]
    k = jnp.where(valid_key, k, jnp.zeros((), k.dtype))
    v = jnp.where(valid_key, v, jnp.zeros((), v.dtype))
    x = core.apply_softcap(core.logits(q, k, scale, acc), softcap)
    x = jnp.where(ok, x, jnp.full((), -jnp.inf, acc))
    if sink is not None:
        sink = jnp.asarray(sink).astype(acc)[None, :, None, None]
    p = core.softmax(x, sink)
    y = core.weighted_values(p.astype(q.dtype), v, acc)
    return jnp.where(i < q_len, y, jnp.zeros((), acc)).astype(q.dtype)
