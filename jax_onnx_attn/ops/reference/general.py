"""Reference general attention: the spec of the CUDA general kernel (ffi/kernels/general/).

The decode engine's rules (`reference.decode`: query row i of S at position
kv_len[b] - S + i + pos_shift, keys visible below kv_len[b] and the bias length, causal and window)
plus what ai.onnx Attention adds that the engine leaves out: V of its own dtype and head size, the
qk_matmul_output modes and the softmax in a chosen dtype. Per batch row, with T1 = q's dtype:

    raw    = scale * q @ k^T                      (f32 accumulation)
    capped = softcap * tanh(raw / softcap)
    x      = capped + bias, -inf where hidden     (by select: a hidden key's K row never reaches x)
    p      = softmax(x cast to softmax_dtype)     (0 rows where no key is visible)
    y      = p.astype(T1) @ V                     (f32 accumulation; V rows past kv_len never read)
    qk     = (raw, capped, x, p)[qk_mode] in T1

Rows of k / v at or past kv_len[b] never reach y or qk modes 2 and 3 (they may hold anything, NaN
included). Modes 0 and 1 are defined on every key of k, as the ONNX spec defines them on every key.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_onnx_attn.ops.reference import core
from jax_onnx_attn.ops.reference.attention import mask_bias
from jax_onnx_attn.ops.reference.decode import visible_keys


def general_attention(q, k, v, kv_len, bias=None, *, scale: float, softcap: float = 0.0,
                      causal: bool = False, left: int = -1, right: int = -1, pos_shift: int = 0,
                      qk_mode: int | None = None, softmax_dtype=None):
    """Attention of q over the first kv_len[b] rows of k / v, with the qk output and softmax dtype.

    Args:
      q: [B, Hq, S, D] float32 / float16 / bfloat16 (T1).
      k: [B, Hkv, C, D] of T1; Hq % Hkv == 0 (head h reads KV head h // (Hq / Hkv)).
      v: [B, Hkv, C, Dv], any of the three float types; Dv may differ from D.
      kv_len: integer [B], clamped to [0, C]; rows at or past it are padding.
      bias: None or [B|1, Hq|1, S|1, Tb]: float / int (added after softcap) or bool (True keeps a
        key); keys j >= Tb are hidden.
      scale, softcap, causal, left, right, pos_shift: as in `reference.decode.decode_attention`.
      qk_mode: None, or the qk_matmul_output_mode whose tensor to return (0 raw, 1 softcapped,
        2 biased, 3 softmax).
      softmax_dtype: the dtype the softmax runs in; None = float32.

    Returns:
      (y [B, Hq, S, Dv] of T1, qk [B, Hq, S, C] of T1 or None).
    """
    t1 = q.dtype
    acc = core.accumulation_dtype(t1)
    s, c = q.shape[2], k.shape[2]
    kv_len = jnp.clip(kv_len.astype(jnp.int32), 0, c)
    ok = visible_keys(kv_len, s, c, causal=causal, left=left, right=right, pos_shift=pos_shift)

    raw = core.logits(q, k, scale, acc)
    capped = core.apply_softcap(raw, softcap)
    x = capped if bias is None else capped + mask_bias(bias[..., :c], c, acc)
    x = jnp.where(ok, x, jnp.full((), -jnp.inf, acc))

    p = core.softmax(x.astype(softmax_dtype if softmax_dtype is not None else acc))
    valid_row = (jnp.arange(c)[None, :] < kv_len[:, None])[:, None, :, None]
    v = jnp.where(valid_row, v, jnp.zeros((), v.dtype))  # so 0 * garbage never reaches p @ v
    y = core.weighted_values(p.astype(t1), v, acc).astype(t1)
    qk = None if qk_mode is None else (raw, capped, x, p)[qk_mode].astype(t1)
    return y, qk
