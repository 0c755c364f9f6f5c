"""The CUDA decode paths of the two attention operators, on the split-KV decode engine.

Each `*_cuda` function looks at a call's static configuration and returns `(cuda_fn, None)` when
the engine covers it, or `(None, reason)` when it does not (the op's `dispatch` then runs the
reference under backend="auto" and raises with the reason under backend="cuda"). A `cuda_fn` has the
signature and results of the reference function the op dispatches to.

Covered: fixed-capacity decode and speculative verify (S <= MAX_QUERY_ROWS new rows per step) in
float16 / bfloat16 with head dims 64, 80, 96, 128, 256.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops import status as st
from jax_onnx_attn.ops.decode import BIAS_DTYPES, cuda_unsupported
from jax_onnx_attn.ops.reference import gqa as gqa_reference

#: Query rows per step the decode engine takes; longer steps are prefill (the reference, until the
#: prefill kernel exists).
MAX_QUERY_ROWS = 64



# --- ai.onnx Attention: ops.attention.attention_with_cache --------------------------------------

def attention_cuda(attrs: dict, *, return_qk: bool, q, key_cache, value_cache):
    """(cuda_fn, reason) for `attention_with_cache`'s dispatch of `reference.attention`.

    cuda_fn(q, key_cache, value_cache, attn_mask, None, None, nonpad) -> (y, key_cache, value_cache,
    None): the engine with kv_len = nonpad (offset nonpad - S, keys >= nonpad hidden) and the
    rank-4 mask as its bias (a short last dim hides the keys past it, as the spec's -inf padding).

    Args:
      attrs: the attention attributes `ops.attention` normalised (scale, softcap, is_causal,
        softmax_dtype, left/right_window_size).
      return_qk: whether the caller wants qk_matmul_output (reference only).
      q: [B, Hq, S, D] float (only its shape and dtype are read).
      key_cache: [B, Hkv, C, D]; value_cache: [B, Hkv, C, Dv] (shapes and dtypes read).
    """
    why = cuda_unsupported(q.dtype, q.shape[-1])
    if why is None and (key_cache.dtype != q.dtype or value_cache.dtype != q.dtype):
        why = "the CUDA decode kernels need Q, K and V of one dtype"
    if why is None and value_cache.shape[-1] != q.shape[-1]:
        why = "the CUDA decode kernels need V's head size equal to Q's"
    if why is None and return_qk:
        why = "qk_matmul_output comes from the reference backend only"
    if why is None and attrs["softmax_dtype"] not in (None, jnp.dtype(jnp.float32)):
        why = "the CUDA decode kernels run the softmax in float32 only"
    if why is None and q.shape[2] > MAX_QUERY_ROWS:
        why = f"more than {MAX_QUERY_ROWS} query rows (prefill) run on the reference backend"
    if why:
        return None, why
    return functools.partial(_attention_decode, scale=attrs["scale"], softcap=attrs["softcap"],
                             causal=attrs["is_causal"], left=attrs["left_window_size"],
                             right=attrs["right_window_size"]), None


def _attention_decode(q, key_cache, value_cache, attn_mask, past_key, past_value, nonpad, *,
                      scale, softcap, causal, left, right):
    del past_key, past_value  # attention_with_cache passes none: the cache is key/value_cache
    if attn_mask is not None and attn_mask.dtype not in BIAS_DTYPES:
        attn_mask = attn_mask.astype(jnp.float32)  # integer masks are added as numbers
    y = cuda.decode_attention(q, key_cache, value_cache, nonpad, attn_mask, None, scale=scale,
                              softcap=softcap, causal=causal, left=left, right=right)
    return y, key_cache, value_cache, None


# --- com.microsoft GroupQueryAttention: ops.gqa.group_query_attention ---------------------------

def gqa_cuda(config, *, query, key, past_key, query_seqlens):
    """(cuda_fn, reason) for `group_query_attention`'s dispatch of `reference.group_query_attention`.

    Covered: a decode / verify step (not a first prompt, no query_seqlens) on a shared fixed-capacity
    float cache (shared_buffer=True), packed or separate Q/K/V, rotary, q/k norm, local window,
    softcap, attention_bias, head_sink / smooth softmax.

    Args:
      config: the op's static `reference.GQAConfig`.
      query: [B, S, N·D], or packed [B, S, (N + 2·Hkv)·D] (shape and dtype read).
      key: [B, S, Hkv·D], [B, 0, Hkv·D] (KV-shared layer) or None (packed query).
      past_key: [B, Hkv, C, D] float, int8/uint8 when quantised, or None.
      query_seqlens: integer [B] or None.
    """
    c = config
    s = query.shape[1]
    checks = (
        (cuda_unsupported(query.dtype, c.head_size), None),
        (past_key is None or not c.shared_buffer, "the CUDA path takes a shared fixed-capacity cache "
                                                  "(past_key with shared_buffer=True)"),
        (c.first_prompt, "a first prompt is prefill: the reference runs it"),
        (query_seqlens is not None, "query_seqlens (chunked prefill) runs on the reference"),
        (key is not None and key.shape[1] != s, "a KV-shared layer (no new K/V rows) runs on the reference"),
        (c.kv_bits != 0, "a quantised KV cache runs on the reference"),
        (c.qk_output != 0, "output_qk comes from the reference only"),
        (c.sliding_window_cache, "a sliding-window cache runs on the reference"),
        (c.local_window_size == 0, "local_window_size 0 (no visible key) runs on the reference"),
        (s > MAX_QUERY_ROWS, f"more than {MAX_QUERY_ROWS} query rows run on the reference"),
    )
    for failed, reason in checks:
        if failed:
            return None, failed if isinstance(failed, str) else reason
    return functools.partial(_gqa_decode, config=c), None


def _gqa_decode(query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache,
                position_ids, attention_bias, head_sink, k_scale, v_scale, q_norm_weight,
                k_norm_weight, query_seqlens, *, config):
    """A GQA decode step: split, q/k norm, rotary, in-place append at past_b, split-KV attention.

    The preparation is the reference's own (split_heads, step_lengths, normalize_and_rotate): only
    the append and the attention run on our kernels.
    """
    del k_scale, v_scale, query_seqlens  # not covered (gqa_cuda says so)
    c = config
    n = c.num_heads
    b, s = query.shape[:2]
    q, k, v = gqa_reference.split_heads(query, key, value, c)
    total_b, past_b, _, _ = gqa_reference.step_lengths(seqlens_k, None, s, s, c)
    q, k = gqa_reference.normalize_and_rotate(q, k, past_b, cos_cache, sin_cache, position_ids,
                                              q_norm_weight, k_norm_weight, False, c)
    capacity = past_key.shape[2]
    # A row whose write or keys would leave the cache is refused: not written, output 0.
    ok = (past_b >= 0) & (total_b <= capacity)
    start = jnp.where(ok, past_b, -1)
    present_k, _ = cuda.kv_append(past_key, k.astype(past_key.dtype), start)
    present_v, _ = cuda.kv_append(past_value, v.astype(past_value.dtype), start)
    status = st.kv_write_status(ok)

    bias = attention_bias
    if bias is not None and bias.shape[-1] < capacity:
        # GQA gives keys past total_sequence_length no bias (not -inf, the engine's default).
        bias = jnp.pad(bias, [(0, 0)] * 3 + [(0, capacity - bias.shape[-1])])
    if head_sink is not None:
        sink = head_sink.astype(jnp.float32)
    elif c.smooth_softmax:
        sink = jnp.zeros((n,), jnp.float32)
    else:
        sink = None
    # GQA's window counts W keys including the query's own: pos - j <= W - 1.
    left = c.local_window_size - 1 if c.local_window_size > 0 else -1
    y = cuda.decode_attention(q, present_k, present_v, jnp.where(ok, total_b, 0), bias, sink,
                              scale=c.scale, softcap=c.softcap, causal=c.causal, left=left)
    output = y.transpose(0, 2, 1, 3).reshape(b, s, n * c.head_size)
    return output, present_k, present_v, None, status
