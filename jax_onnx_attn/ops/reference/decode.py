"""Reference decode attention over a fixed-capacity KV cache: the spec of the CUDA decode engine.

Composed from `core` the way both operators compose it:

    x = scale * q @ k^T  ->  softcap  ->  + bias, hidden keys -inf  ->  softmax (+ sink)  ->  p @ v

Query row i of S sits at absolute position pos_i = kv_len[b] - S + i + pos_shift (pos_shift is
static, 0 by default: bottom-right alignment). Key j is visible to it when
j < kv_len[b], j < T (the bias length, if a bias is given), and, if enabled, j <= pos_i (causal),
pos_i - j <= left, j - pos_i <= right. Cache rows at or beyond kv_len[b] are never read (they may
hold anything, NaN included). kv_len is clamped to [0, C]. A row with no visible key gives 0.

A quantised cache (kv_bits 8: int8 [B, Hkv, C, D]; 4: uint8 [B, Hkv, C, D/2]) is read as
`quant.dequantize(cache, scale, kv_bits, q.dtype)`: each value q.dtype(float32(x) * scale), a
scale of 0 counting as 1, then attended to as a float cache.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_onnx_attn.ops.reference import core, quant


def visible_keys(kv_len, q_len: int, capacity: int, *, causal: bool, left: int = -1, right: int = -1,
                 pos_shift: int = 0):
    """Boolean [B, 1, S, C]: which cache rows each query row may attend to."""
    length = kv_len.astype(jnp.int32)[:, None, None, None]
    pos = length - q_len + pos_shift + jnp.arange(q_len, dtype=jnp.int32)[None, None, :, None]
    ok = core.key_window(pos, capacity, causal=causal, left=left, right=right)
    ok = ok & (jnp.arange(capacity, dtype=jnp.int32) < length)
    return ok


def dequantize_cache(cache, scale, kv_bits: int, dtype):
    """A quantised cache [B, Hkv, C, D] int8 / [B, Hkv, C, D/2] uint8 -> dtype [B, Hkv, C, D].

    scale: float32 of 1 element (per tensor) or Hkv·D elements (per channel, [1, Hkv, 1, D]).
    """
    scale = jnp.asarray(scale, jnp.float32)
    scale = scale.reshape(()) if scale.size == 1 else scale.reshape(1, cache.shape[1], 1, -1)
    return quant.dequantize(cache, scale, kv_bits, dtype)


def decode_attention(q, k_cache, v_cache, kv_len, bias=None, sink=None, k_scale=None, v_scale=None,
                     *, scale: float, softcap: float = 0.0, causal: bool = True, left: int = -1,
                     right: int = -1, pos_shift: int = 0, kv_bits: int = 0):
    """q [B, Hq, S, D], k_cache / v_cache [B, Hkv, C, D], kv_len int [B] -> [B, Hq, S, D] (q.dtype).

    bias: None or [B|1, Hq|1, S|1, T] float (added) or bool (True keeps); keys j >= T are hidden.
    sink: None or [Hq] extra logit per query head (enters the max and the denominator only).
    kv_bits 8 / 4: quantised caches with k_scale / v_scale (see `dequantize_cache`).
    """
    if kv_bits:
        k_cache = dequantize_cache(k_cache, k_scale, kv_bits, q.dtype)
        v_cache = dequantize_cache(v_cache, v_scale, kv_bits, q.dtype)
    b, hq, s, d = q.shape
    c = k_cache.shape[2]
    acc = core.accumulation_dtype(q.dtype)
    kv_len = jnp.clip(kv_len.astype(jnp.int32), 0, c)
    ok = visible_keys(kv_len, s, c, causal=causal, left=left, right=right, pos_shift=pos_shift)
    # Rows past the valid length may be uninitialised: zero them so 0 * garbage never reaches p @ v.
    valid_row = (jnp.arange(c)[None, :] < kv_len[:, None])[:, None, :, None]
    k_cache = jnp.where(valid_row, k_cache, jnp.zeros((), k_cache.dtype))
    v_cache = jnp.where(valid_row, v_cache, jnp.zeros((), v_cache.dtype))

    x = core.apply_softcap(core.logits(q, k_cache, scale, acc), softcap)
    if bias is not None:
        t = bias.shape[-1]
        if bias.dtype == jnp.bool_:
            add = jnp.where(bias, jnp.zeros((), acc), jnp.full((), -jnp.inf, acc))
        else:
            add = bias.astype(acc)
        width = min(t, c)
        add = add[..., :width]
        if width < c:  # keys past the bias are hidden
            add = jnp.pad(add, [(0, 0)] * 3 + [(0, c - width)], constant_values=-jnp.inf)
        x = x + add
    x = jnp.where(ok, x, jnp.full((), -jnp.inf, acc))
    sink_logit = None if sink is None else sink.astype(acc)[None, :, None, None]
    p = core.softmax(x, sink_logit)
    return core.weighted_values(p.astype(q.dtype), v_cache, acc).astype(q.dtype)
