"""Reference ai.onnx Attention (opsets 23-25): the executable spec the CUDA kernels are held to.

Inputs arrive normalised by `jax_onnx_attn.ops.attention` (BHSD layout, rank-4 mask, static attributes
resolved), so this module is only the math of the ONNX spec (onnx 1.23.2, errata included):

    logits = scale * Q @ K^T                        (f32 accumulation for half types)
    logits = softcap * tanh(logits / softcap)       (before any bias, onnx#7867)
    x      = logits + mask_bias + structural_bias   (structural = causal, window, nonpad padding)
    p      = softmax(x in softmax_dtype); rows whose bias is all -inf -> 0
    Y      = p.astype(T1) @ V

Causal and window bounds are offset-aligned: query i sits at absolute position i + offset, with
offset = past length (a Python int), nonpad_kv_seqlen[b] - S (per batch), or 0.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_onnx_attn.ops.reference import core

#: qk_matmul_output_mode values: raw scaled QK^T, after softcap, after all biases, softmax.
QK_RAW, QK_SOFTCAP, QK_BIAS, QK_SOFTMAX = 0, 1, 2, 3


def mask_bias(mask, total: int, acc):
    """Additive bias [b|1, h|1, S|1, T] from a rank-4 bool / int / float mask whose last dim is <= T.

    Bool masks become 0 / -inf with a select (never (1 - m) * -inf, which makes NaN); int and float
    masks are added as numbers. A short last dim is padded with -inf (False for bool).
    """
    if mask.dtype == jnp.bool_:
        bias = jnp.where(mask, jnp.zeros((), acc), jnp.full((), -jnp.inf, acc))
    else:
        bias = mask.astype(acc)
    pad = total - mask.shape[-1]
    if pad > 0:
        bias = jnp.pad(bias, [(0, 0)] * 3 + [(0, pad)], constant_values=-jnp.inf)
    return bias


def _allowed(s: int, t: int, offset, nonpad, *, is_causal: bool, left: int, right: int):
    """Boolean [B|1, 1, S, T] of keys that causal, window and nonpad padding leave visible, or None.

    `offset` is a Python int or an int32 [B] array; `nonpad` is None or int32 [B].
    """
    if not (is_causal or left >= 0 or right >= 0 or nonpad is not None):
        return None
    i = jnp.arange(s, dtype=jnp.int32)[:, None]
    if isinstance(offset, int):
        pos = (i + offset)[None, None]                       # [1, 1, S, 1]
    else:
        pos = offset.astype(jnp.int32)[:, None, None, None] + i  # [B, 1, S, 1]
    allowed = core.key_window(pos, t, causal=is_causal, left=left, right=right)
    if nonpad is not None:
        j = jnp.arange(t, dtype=jnp.int32)
        allowed = allowed & (j < nonpad.astype(jnp.int32)[:, None, None, None])
    return allowed


def attention(q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *,
              scale: float, is_causal: bool = False, softcap: float = 0.0,
              qk_matmul_output_mode: int = QK_RAW, softmax_dtype=None, left_window_size: int = -1,
              right_window_size: int = -1, return_qk: bool = False):
    """ONNX Attention on normalised inputs.

    Args:
      q: [B, Hq, S, D] of T1 (float16 / bfloat16 / float32 / float64).
      k: [B, Hkv, L, D] of T1; Hq % Hkv == 0 (query head h uses KV head h // (Hq // Hkv)).
      v: [B, Hkv, L, Dv] of T2 (any float type).
      attn_mask: None or rank 4 [B|1, Hq|1, S|1, Tm] of bool / int / float with Tm <= T = P + L.
      past_key, past_value: None (both) or [B, Hkv, P, D] of T1 and [B, Hkv, P, Dv] of T2.
      nonpad_kv_seqlen: None or integer [B] (never together with past): keys j >= nonpad[b] are
        padding, and the causal / window offset of batch b is nonpad[b] - S.
      scale: multiplies Q @ K^T (the caller resolves the 1/sqrt(D) default).
      is_causal, softcap, left_window_size, right_window_size: as in the ONNX schema.
      qk_matmul_output_mode: 0 raw scaled QK^T, 1 after softcap, 2 after all biases, 3 softmax.
      softmax_dtype: dtype the biased logits are cast to for the softmax; None = the accumulation
        dtype (float32 for half types, float64 for float64).
      return_qk: compute the fourth output.

    Returns:
      (y [B, Hq, S, Dv] of T1, present_key [B, Hkv, T, D], present_value [B, Hkv, T, Dv],
       qk [B, Hq, S, T] of T1 or None).
    """
    t1 = q.dtype
    acc = core.accumulation_dtype(jnp.promote_types(t1, v.dtype))
    if past_key is not None:
        present_key = jnp.concatenate([past_key, k], axis=2)
        present_value = jnp.concatenate([past_value, v], axis=2)
        offset = past_key.shape[2]
    else:
        present_key, present_value = k, v
        offset = 0 if nonpad_kv_seqlen is None else nonpad_kv_seqlen.astype(jnp.int32) - q.shape[2]
    s, t = q.shape[2], present_key.shape[2]

    bias = None
    if attn_mask is not None:
        bias = mask_bias(attn_mask, t, acc)
    allowed = _allowed(s, t, offset, nonpad_kv_seqlen, is_causal=bool(is_causal),
                       left=left_window_size, right=right_window_size)
    if allowed is not None:
        structural = jnp.where(allowed, jnp.zeros((), acc), jnp.full((), -jnp.inf, acc))
        bias = structural if bias is None else bias + structural

    raw = core.logits(q, present_key, scale, acc)
    capped = core.apply_softcap(raw, softcap)
    x = capped if bias is None else capped + bias

    sm_dtype = jnp.dtype(softmax_dtype) if softmax_dtype is not None else acc
    p = core.softmax(x.astype(sm_dtype))
    if bias is not None:
        # The spec decides "fully masked" on the bias, not on the logits: a row with no allowed key
        # is 0 in Y and in mode 3, whatever the logits hold (even +inf or NaN).
        empty = jnp.all(jnp.isneginf(bias), axis=-1, keepdims=True)
        p = jnp.where(empty, jnp.zeros((), p.dtype), p)

    qk = None
    if return_qk:
        qk = (raw, capped, x, p)[qk_matmul_output_mode].astype(t1)
    # The spec casts the probabilities to T1 before P @ V (the kernels feed T1 to the MMA too).
    y = core.weighted_values(p.astype(t1), present_value, acc).astype(t1)
    return y, present_key, present_value, qk
