"""The CUDA decode paths of the two attention operators, on the split-KV decode engine (and, for
ai.onnx Attention, the general CUDA-core kernel for what the engine does not take).

Each `*_cuda` function looks at a call's static configuration and returns `(cuda_fn, None)` when
our kernels cover it, or `(None, reason)` when it does not (the op's `dispatch` then runs the
reference under backend="auto" and raises with the reason under backend="cuda"). A `cuda_fn` has the
signature and results of the reference function the op dispatches to.

Covered: decode and speculative verify steps (S <= MAX_QUERY_ROWS query rows). The engine takes
float16 / bfloat16 with the head dims it is compiled for (cuda.DECODE_HEAD_DIMS, from the
extension); ai.onnx Attention's other calls of that size (float32, mixed dtypes or head sizes,
qk_matmul_output, a half softmax) take the general kernel. Prompts (more query rows) of both
operators run on our Hopper prefill engine (sm_90) where it computes them exactly; GQA's fall back
to cuDNN, then to the reference, ai.onnx Attention's to the reference.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax

from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops import status as st
from jax_onnx_attn.ops.decode import BIAS_DTYPES, cuda_unsupported
from jax_onnx_attn.ops.dtypes import CUDA_FLOAT_DTYPES, HALF_DTYPES
from jax_onnx_attn.ops.reference import kv_cache as kv_cache_reference
from jax_onnx_attn.ops.reference.decode import visible_keys

#: Query rows per step the decode engine takes; longer steps are prefill (the prefill routes below,
#: or the reference).
MAX_QUERY_ROWS = 64



# --- ai.onnx Attention: ops.attention.attention and attention_with_cache ------------------------

def attention_cuda(attrs: dict, *, return_qk: bool, q, present_key, present_value,
                   cache: str = "none", new_rows: int | None = None, has_mask: bool = False):
    """(cuda_fn, reason) for the dispatch of `reference.attention` by `attention` (the ONNX form,
    with or without past / nonpad_kv_seqlen) and by `attention_with_cache`.

    A prompt (more than MAX_QUERY_ROWS query rows) runs on the prefill engine where it computes the
    call exactly (`attention_prefill_route`), on the reference otherwise.

    A step of at most MAX_QUERY_ROWS query rows runs on the split-KV engine where it covers the call
    (`_engine_covers`) and on the general CUDA-core kernel otherwise: float32 / float16 / bfloat16,
    any head sizes, V's dtype and head size of its own, every qk_matmul_output mode and softmax
    dtype. cuda_fn(q, k, v, attn_mask, past_key, past_value, nonpad) -> (y, present_key,
    present_value, qk) has the reference's signature and results (see `_attention_step`).

    Args:
      attrs: the attention attributes `ops.attention` normalised (scale, softcap, is_causal,
        qk_matmul_output_mode, softmax_dtype, left/right_window_size).
      return_qk: whether the caller wants qk_matmul_output.
      q: [B, Hq, S, D] (shape and dtype read).
      present_key, present_value: [B, Hkv, T, D] / [B, Hkv, T, Dv], the K and V the attention reads
        (past and new rows, or the whole cache); arrays or ShapeDtypeStructs (shapes and dtypes read).
      cache, new_rows, has_mask: what the prefill route needs to place the query rows (the decode
        kernels read it from the arguments): "none", "past" (P = T - new_rows) or "nonpad"
        (nonpad_kv_seqlen given; attention_with_cache's form); L = new_rows K / V rows given
        (None: T); whether attn_mask is given.
    """
    if q.shape[2] > MAX_QUERY_ROWS:
        fn, why = attention_prefill_route(attrs, return_qk=return_qk, q=q, present_key=present_key,
                                          present_value=present_value, cache=cache,
                                          new_rows=new_rows, has_mask=has_mask)
        if fn is None:
            why = (f"more than {MAX_QUERY_ROWS} query rows (prefill) run on the reference backend: "
                   f"{why}")
        return fn, why
    engine = _engine_covers(attrs, return_qk, q, present_key, present_value)
    if not engine:
        why = _general_unsupported(attrs, q, present_key, present_value)
        if why:
            return None, why
    return functools.partial(
        _attention_step, engine=engine, scale=attrs["scale"], softcap=attrs["softcap"],
        causal=attrs["is_causal"], left=attrs["left_window_size"],
        right=attrs["right_window_size"],
        qk_mode=attrs["qk_matmul_output_mode"] if return_qk else None,
        softmax_dtype=attrs["softmax_dtype"]), None


def _engine_covers(attrs, return_qk, q, key, value) -> bool:
    """Whether the split-KV engine takes the call: float16 / bfloat16 Q, K and V of one dtype, a head
    size of cuda.DECODE_HEAD_DIMS shared by V, no qk output, a float32 softmax, at least one key."""
    softmax = attrs["softmax_dtype"]  # `is None`: numpy's dtype == None is float64
    return (cuda_unsupported(q.dtype, q.shape[-1]) is None and key.dtype == q.dtype == value.dtype
            and value.shape[-1] == q.shape[-1] and not return_qk
            and (softmax is None or softmax == jnp.float32) and key.shape[2] > 0)


def _general_unsupported(attrs, q, key, value) -> str | None:
    """Why the general kernel cannot take a call (K has Q's dtype: the op checks it), or None."""
    for name, x in (("Q", q), ("V", value)):
        if x.dtype not in CUDA_FLOAT_DTYPES:
            return f"{name} is {x.dtype}: the CUDA kernels take float32, float16 and bfloat16"
    softmax = attrs["softmax_dtype"]
    if softmax is not None and softmax not in cuda.GENERAL_SOFTMAX_DTYPES:
        return (f"softmax_precision {softmax} runs on the reference backend (the CUDA kernels run "
                f"the softmax in float32, float16 or bfloat16)")
    if key.shape[2] > cuda.GENERAL_MAX_KEYS:
        return f"more than {cuda.GENERAL_MAX_KEYS} keys run on the reference backend"
    return None


def _attention_step(q, k, v, attn_mask, past_key, past_value, nonpad, *, engine, scale, softcap,
                    causal, left, right, qk_mode, softmax_dtype):
    """present = concat(past, new) as the spec has it (new outputs: an XLA concatenation), then one
    kernel over present.

    The kernels place query row i at kv_len[b] - S + i + pos_shift; the spec at i + offset. With
    nonpad: kv_len = nonpad, pos_shift 0 (offset nonpad - S, keys >= nonpad hidden). Otherwise:
    kv_len = T = P + L, pos_shift = S - L (offset P with past, 0 without: top-left when S < L).
    The rank-4 mask is the bias; a short last dim hides the keys past it (the spec's -inf padding).
    A row the mask leaves no key is 0 in y and mode-3 qk (`_fully_masked_rows`).
    """
    new_rows = k.shape[2]
    if past_key is not None:
        k = jnp.concatenate([past_key, k], axis=2)
        v = jnp.concatenate([past_value, v], axis=2)
    b, _, s, _ = q.shape
    if nonpad is not None:
        kv_len, pos_shift = nonpad, 0
    else:
        kv_len, pos_shift = jnp.full((b,), k.shape[2], jnp.int32), s - new_rows
    bias = attn_mask
    if bias is not None and bias.dtype not in BIAS_DTYPES:
        bias = bias.astype(jnp.float32)  # integer masks are added as numbers (float64 as float32)
    static = dict(scale=scale, softcap=softcap, causal=causal, left=left, right=right,
                  pos_shift=pos_shift)
    if engine:
        y, qk = cuda.decode_attention(q, k, v, kv_len, bias, **static), None
    else:
        y, qk = cuda.general_attention(q, k, v, kv_len, bias, qk_mode=qk_mode,
                                       softmax_dtype=softmax_dtype, **static)
    if attn_mask is not None:
        empty = _fully_masked_rows(attn_mask, kv_len, s, k.shape[2], causal=causal, left=left,
                                   right=right, pos_shift=pos_shift)
        y = jnp.where(empty, jnp.zeros((), y.dtype), y)
        if qk_mode == 3:
            qk = jnp.where(empty, jnp.zeros((), qk.dtype), qk)
    return y, k, v, qk


def _fully_masked_rows(attn_mask, kv_len, s: int, c: int, *, causal, left, right, pos_shift):
    """Boolean [B, Hq|1, S, 1]: the query rows whose every key is hidden, by the mask (False / -inf)
    or by lengths, causal and window.

    The spec decides "fully masked" on the bias, not on the logits: such a row is 0 whatever its
    logits hold. The kernels add the mask's -inf to the logit, so a NaN or +inf logit at a masked
    key would make the row NaN (NaN + -inf); selecting 0 here restores the spec's 0 (without a mask
    the kernels hide keys by select, and a row with no visible key is 0 already).
    """
    keep = attn_mask if attn_mask.dtype == jnp.bool_ else ~jnp.isneginf(attn_mask)
    keep = keep[..., :c]
    if keep.shape[-1] < c:  # the short mask's padding hides the keys past it
        keep = jnp.pad(keep, [(0, 0)] * 3 + [(0, c - keep.shape[-1])])
    seen = keep & visible_keys(kv_len, s, c, causal=causal, left=left, right=right,
                               pos_shift=pos_shift)
    return ~jnp.any(seen, axis=-1, keepdims=True)


def _route(checks, cuda_fn):
    """(cuda_fn, None), or (None, reason) for the first failed check: checks are (failed, reason)
    pairs, a failed value that is itself a string being its own reason."""
    for failed, reason in checks:
        if failed:
            return None, failed if isinstance(failed, str) else reason
    return cuda_fn, None


# --- com.microsoft GroupQueryAttention: ops.gqa.group_query_attention ---------------------------

def gqa_cuda(config, *, query, key, past_key, query_seqlens, has_bias: bool = False,
             has_sink: bool = False):
    """(cuda_fn, reason) for `group_query_attention`'s dispatch of `reference.group_query_attention`.

    Covered: a decode / verify step (not a first prompt, no query_seqlens; more than MAX_QUERY_ROWS
    rows, e.g. a later prompt chunk, where the prefill engine takes them) on a shared fixed-capacity
    cache (shared_buffer=True) of the query's dtype or int8 / int4 (per-tensor or per-channel
    scales), packed or separate Q/K/V, rotary, q/k norm, local window, softcap, attention_bias,
    head_sink / smooth softmax.

    Args:
      config: the op's static `reference.GQAConfig`.
      query: [B, S, N·D], or packed [B, S, (N + 2·Hkv)·D] (shape and dtype read).
      key: [B, S, Hkv·D], [B, 0, Hkv·D] (KV-shared layer) or None (packed query).
      past_key: [B, Hkv, C, D] float, int8/uint8 when quantised, or None.
      query_seqlens: integer [B] or None.
      has_bias, has_sink: whether attention_bias / head_sink are given (the prompt routes take
        neither / only the engine's takes a sink).
    """
    c = config
    s = query.shape[1]
    if c.past_empty and s > MAX_QUERY_ROWS:
        return _gqa_prefill_route(config, query=query, key=key, past_key=past_key,
                                  has_bias=has_bias, has_sink=has_sink)
    checks = (
        (cuda_unsupported(query.dtype, c.head_size), None),
        (past_key is None or not c.shared_buffer, "the CUDA path takes a shared fixed-capacity cache "
                                                  "(past_key with shared_buffer=True)"),
        (c.first_prompt, "a first prompt is prefill: the reference runs it"),
        (query_seqlens is not None, "query_seqlens (chunked prefill) runs on the reference"),
        (key is not None and key.shape[1] != s, "a KV-shared layer (no new K/V rows) runs on the reference"),
        (c.qk_output != 0, "output_qk comes from the reference only"),
        (c.sliding_window_cache, "a sliding-window cache runs on the reference"),
        (c.local_window_size == 0, "local_window_size 0 (no visible key) runs on the reference"),
        (s > MAX_QUERY_ROWS and not _chunk_on_prefill_engine(c, query, has_bias),
         f"more than {MAX_QUERY_ROWS} query rows on a filled cache run on the reference unless the "
         "prefill engine takes them (sm_90, a float cache, a head size it has, no attention_bias)"),
        (past_key is not None and s > past_key.shape[2],
         "more query rows than the cache holds run on the reference"),
    )
    return _route(checks, functools.partial(_gqa_decode, config=c))


def _chunk_on_prefill_engine(c, query, has_bias: bool) -> bool:
    """Whether a step of more than MAX_QUERY_ROWS query rows on a filled cache (a later prompt chunk,
    a long verify) runs on the prefill engine: gqa_prepare appends it, then the engine attends over
    the cache from each row's position (the decode path with decode_attention(engine="prefill"))."""
    return (prefill_engine_enabled() and prefill_engine_available() and not c.kv_bits and not has_bias
            and jnp.dtype(query.dtype) in HALF_DTYPES and c.head_size in cuda.PREFILL_HEAD_DIMS)


def _decode_kv_len(seqlens_k, s: int, capacity: int):
    """Keys each row's decode attention reads: T_b = seqlens_k + 1, or 0 (output 0) for a row
    whose S new rows gqa_prepare refuses to write (past_b = T_b - S, the kernel's fit rule). Derived
    from seqlens_k, not from the prepare's status output, so that every layer of a step computes
    the same value and XLA computes it once instead of a kernel per layer."""
    t = seqlens_k.astype(jnp.int32) + 1
    return jnp.where(kv_cache_reference.append_fits(t - s, s, capacity), t, 0)


def projected_prepare_unsupported(config, query, key, value, past_key, past_value, seqlens_k,
                                  cos_cache, sin_cache, position_ids, attention_bias, head_sink,
                                  k_scale, v_scale, q_norm_weight, k_norm_weight, query_seqlens, *,
                                  projection) -> str | None:
    """Why a GQA decode step that `gqa_cuda` covers does not take `gqa_decode_projected` (None when
    it does): one row (B = S = 1) of a packed query with rotary (not interleaved, the projection's
    R/2), no q / k norm, a float cache of the query's dtype, and a projection the fused kernel's plan
    takes (`cuda_matmul.qkv_prepare_unsupported`)."""
    from jax_onnx_attn.ops import cuda_matmul

    c, p = config, projection
    n_rows = (c.num_heads + 2 * c.kv_num_heads) * c.head_size
    checks = (
        (query.shape[:2] != (1, 1) or math.prod(p.x.shape[:-1]) != 1,
         "the fused projection takes one decode row (B = S = 1)"),
        (key is not None, "the fused projection makes a packed query"),
        (c.kv_bits != 0 or past_key.dtype != query.dtype, "the fused projection writes a float cache"),
        (not c.do_rotary or c.rotary_interleaved or cos_cache is None
         or cos_cache.shape[-1] != p.rotary_half, "the fused projection rotates halves at its order's R/2"),
        (q_norm_weight is not None, "q / k norm runs in gqa_prepare"),
        (p.x.dtype != query.dtype, "the projection's x is not of the query's dtype"),
    )
    for failed, why in checks:
        if failed:
            return why
    # linear_gqa_prepare checks the rest at trace time (w's and norm_weight's shapes against x's K).
    return cuda_matmul.qkv_prepare_unsupported(n_rows, p.x.shape[-1], p.bits, p.norm_weight is not None,
                                               p.block_size)


def gqa_decode_projected(query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache,
                         position_ids, attention_bias, head_sink, k_scale, v_scale, q_norm_weight,
                         k_norm_weight, query_seqlens, x, w, bias, norm_weight, *, config, bits,
                         block_size, eps):
    """`_gqa_decode` with the packed query's projection and the step preparation in one launch
    (`cuda_matmul.linear_gqa_prepare`; `projected_prepare_unsupported` says when): `query` is not
    read (XLA drops the projection that made it)."""
    from jax_onnx_attn.ops import cuda_matmul

    del query, key, value, q_norm_weight, k_norm_weight, k_scale, v_scale
    c = config
    prepared = cuda_matmul.linear_gqa_prepare(
        x.reshape(1, x.shape[-1]), w, bias, norm_weight, past_key, past_value, seqlens_k, cos_cache,
        sin_cache, position_ids, num_heads=c.num_heads, kv_num_heads=c.kv_num_heads, bits=bits,
        block_size=block_size, eps=eps)
    return _decode_prepared(prepared, seqlens_k, s=1, attention_bias=attention_bias,
                            head_sink=head_sink, k_scale=None, v_scale=None, config=c)


def _gqa_decode(query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache,
                position_ids, attention_bias, head_sink, k_scale, v_scale, q_norm_weight,
                k_norm_weight, query_seqlens, *, config):
    """A GQA decode step in two launches: gqa_prepare (split, q/k norm, rotary, the new K/V rows
    written in place at past_b, quantised when kv_bits) then the split-KV decode engine."""
    del query_seqlens  # not covered (gqa_cuda says so)
    c = config
    prepared = cuda.gqa_prepare(
        query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache, position_ids,
        q_norm_weight, k_norm_weight, k_scale, v_scale, num_heads=c.num_heads,
        kv_num_heads=c.kv_num_heads, rotary_interleaved=c.rotary_interleaved,
        q_norm_epsilon=c.q_norm_epsilon, k_norm_epsilon=c.k_norm_epsilon, kv_bits=c.kv_bits)
    return _decode_prepared(prepared, seqlens_k, s=query.shape[1], attention_bias=attention_bias,
                            head_sink=head_sink, k_scale=k_scale, v_scale=v_scale, config=c)


def _decode_prepared(prepared, seqlens_k, *, s, attention_bias, head_sink, k_scale, v_scale, config):
    """The split-KV engine over a prepared step: (q [B, N, S, D], the caches with the new rows,
    status) -> the op's results."""
    c = config
    n = c.num_heads
    q, present_k, present_v, status = prepared
    b = q.shape[0]
    capacity = present_k.shape[2]
    kv_len = _decode_kv_len(seqlens_k, s, capacity)

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
    dequant = {}
    if c.kv_bits:
        # The engine reads the quantised cache dequantised (keyword names to match its wrapper).
        dequant = dict(k_scale=k_scale, v_scale=v_scale, kv_bits=c.kv_bits)
    # More rows than the decode engine takes: the prefill engine (gqa_cuda checked that it covers them).
    engine = dict(engine="prefill") if s > MAX_QUERY_ROWS else {}
    y = cuda.decode_attention(q, present_k, present_v, kv_len, bias, sink, scale=c.scale,
                              softcap=c.softcap, causal=c.causal, left=left, **engine, **dequant)
    output = y.transpose(0, 2, 1, 3).reshape(b, s, n * c.head_size)
    return output, present_k, present_v, None, status


# --- prompts (prefill) on cuDNN: until our own prefill engine exists ----------------------------

#: Head sizes cuDNN's fused attention takes (multiples of 8 up to 256 on Hopper).
CUDNN_MAX_HEAD_DIM = 256


@functools.cache
def cudnn_attention_available() -> bool:
    """Whether jax can lower `jax.nn.dot_product_attention(implementation="cudnn")` here: a CUDA
    jaxlib that finds cuDNN. Tracing the cuDNN branch raises without one, even for a branch of
    `lax.platform_dependent` that is never compiled, so the route is offered only when this holds."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
        check_cudnn_version()
        return True
    except Exception:  # noqa: BLE001 - no CUDA jaxlib, no cuDNN, or a jax without the module
        return False


def _gqa_prefill_route(config, *, query, key, past_key, has_bias=False, has_sink=False):
    """(cuda_fn, reason) for a first prompt on a fixed-capacity cache (config.past_empty): the
    gqa_prepare kernel, then cuDNN's flash attention over the S new rows (causal from position 0,
    exactly GQA's rule when no row has a past). What cuDNN does not compute exactly stays on the
    reference: softcap, attention_bias, sinks, quantised caches, qk outputs.

    Unless JOA_PREFILL_ENGINE=0 (`prefill_engine_enabled`), a prompt our prefill engine covers
    (`gqa_prefill_engine_route`) runs on it instead; one it does not cover takes this route as before,
    and when that falls back to the reference too the reason names both."""
    engine_why = None
    if prefill_engine_enabled():
        engine_fn, engine_why = gqa_prefill_engine_route(config, query=query, key=key,
                                                         past_key=past_key, has_bias=has_bias)
        if engine_fn is not None:
            return engine_fn, None
    fn, why = _gqa_cudnn_prefill_route(config, query=query, key=key, past_key=past_key,
                                       has_bias=has_bias, has_sink=has_sink)
    if fn is None and engine_why is not None:
        why = f"{why} (and the prefill engine: {engine_why})"
    return fn, why


def _prompt_shape_checks(c, *, query, key, past_key):
    """The checks both prompt routes share: no qk output, new K/V rows, the prompt fits the cache."""
    return (
        (c.qk_output != 0, "output_qk comes from the reference only"),
        (key is not None and key.shape[1] != query.shape[1],
         "a KV-shared layer (no new K/V rows) runs on the reference"),
        (query.shape[1] > past_key.shape[2], "more query rows than the cache holds"),
    )


def _gqa_cudnn_prefill_route(config, *, query, key, past_key, has_bias=False, has_sink=False):
    """(cuda_fn, reason) of the cuDNN prefill route (`_gqa_prefill`)."""
    c = config
    checks = (
        (query.dtype not in HALF_DTYPES,
         f"a prompt in {query.dtype} runs on the reference (cuDNN takes float16 and bfloat16)"),
        (c.head_size % 8 or c.head_size > CUDNN_MAX_HEAD_DIM,
         f"head size {c.head_size}: cuDNN takes multiples of 8 up to {CUDNN_MAX_HEAD_DIM}"),
        (not cudnn_attention_available(), "cuDNN attention is not available to jax here"),
        (not c.causal, "a non-causal prompt runs on the reference"),
        (c.softcap > 0, "softcap on a prompt runs on the reference (cuDNN has no softcap)"),
        (c.smooth_softmax or has_sink, "smooth softmax / head_sink on a prompt runs on the reference"),
        (has_bias, "attention_bias on a prompt runs on the reference"),
        (c.kv_bits, "a prompt into a quantised cache runs on the reference"),
    ) + _prompt_shape_checks(c, query=query, key=key, past_key=past_key)
    return _route(checks, functools.partial(_gqa_prefill, config=c))


def _prompt_prepare(c, query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache,
                    position_ids, q_norm_weight, k_norm_weight):
    """gqa_prepare on a prompt, for both prompt routes -> (q [B, N, S, D], present_k, present_v,
    status). GQA's first prompt (S == total) writes all S rows at row 0 (past_b = 0) whatever T_b
    and refuses a row only when T_b > C; gqa_prepare writes at T_b - S (a decode step's rule), so it
    gets S - 1 for a row that fits and seqlens_k (which it refuses) for one that does not (handing
    it seqlens_k refused every right-padded row). Rotary on a first prompt reads
    position_ids[0, 0] + s only (onnxruntime's quirk). Other prompts pass through."""
    b, s = query.shape[:2]
    if c.first_prompt:
        fits = seqlens_k.astype(jnp.int32) + 1 <= past_key.shape[2]
        seqlens_k = jnp.where(fits, s - 1, seqlens_k).astype(seqlens_k.dtype)
        if position_ids is not None:
            steps = jnp.arange(s, dtype=position_ids.dtype)
            position_ids = jnp.broadcast_to(position_ids[0, 0] + steps, (b, s))
    return cuda.gqa_prepare(
        query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache, position_ids,
        q_norm_weight, k_norm_weight, num_heads=c.num_heads, kv_num_heads=c.kv_num_heads,
        rotary_interleaved=c.rotary_interleaved, q_norm_epsilon=c.q_norm_epsilon,
        k_norm_epsilon=c.k_norm_epsilon)


def _gqa_prefill(query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache,
                 position_ids, attention_bias, head_sink, k_scale, v_scale, q_norm_weight,
                 k_norm_weight, query_seqlens, *, config):
    """A first prompt on a shared cache: gqa_prepare (split, q/k norm, rotary, the S new rows written
    in place at row 0) then cuDNN flash attention over those rows, causal from position 0, keys
    limited to each row's T_b = seqlens_k + 1 (a padded query sees all T_b keys, as GQA says)."""
    del query_seqlens, k_scale, v_scale  # not covered (the route says so)
    if attention_bias is not None or head_sink is not None:
        raise AssertionError("the prefill route excludes attention_bias and head_sink")
    import jax

    c = config
    n, d = c.num_heads, c.head_size
    b, s = query.shape[:2]
    q, present_k, present_v, status = _prompt_prepare(
        c, query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache, position_ids,
        q_norm_weight, k_norm_weight)
    ok = status == st.OK
    kv_len = jnp.where(ok, jnp.clip(seqlens_k + 1, 1, s), 1).astype(jnp.int32)
    # cuDNN's layout is [B, S, heads, D].
    q = q.transpose(0, 2, 1, 3)
    k = present_k[:, :, :s].transpose(0, 2, 1, 3)
    v = present_v[:, :, :s].transpose(0, 2, 1, 3)
    window = None
    if c.local_window_size > 0:
        window = (c.local_window_size - 1, 0)  # GQA's W counts the query's own key
    y = jax.nn.dot_product_attention(q, k, v, scale=c.scale, is_causal=True,
                                     key_value_seq_lengths=kv_len, local_window_size=window,
                                     implementation="cudnn")
    # A refused row (its write would leave the cache) gives 0, as on the decode path.
    y = jnp.where(ok[:, None, None, None], y, jnp.zeros_like(y))
    return y.reshape(b, s, n * d), present_k, present_v, None, status


# --- prompts (prefill) on our Hopper prefill engine: the default, JOA_PREFILL_ENGINE=0 for cuDNN --

#: The environment variable that routes covered GQA first prompts to `cuda.prefill_attention`.
PREFILL_ENGINE_ENV = "JOA_PREFILL_ENGINE"


def prefill_engine_enabled() -> bool:
    """Whether GQA first prompts go to our prefill engine (JOA_PREFILL_ENGINE, "0" or "1", default
    "1"; "0": cuDNN's route), and ai.onnx Attention prompts ("0": the reference). Read at trace time, here only: a jit traced before a change keeps its
    route. On the H200 the 1B fp16 prefill took 10.1 ms at 2k tokens (cuDNN's route 10.9) and 43.7
    at 8k (43.5; bench/results/2026-12-01-6d7d911-e2e-ab.json)."""
    value = os.environ.get(PREFILL_ENGINE_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{PREFILL_ENGINE_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


@functools.cache
def prefill_engine_available() -> bool:
    """Whether the local GPU is sm_90 (H100 / H200), the one the prefill engine launches on; False
    without a GPU."""
    import jax
    try:
        dev = jax.devices("gpu")[0]
        return str(getattr(dev, "compute_capability", "")) == "9.0"
    except (RuntimeError, ValueError, IndexError):
        return False


def gqa_prefill_engine_route(config, *, query, key, past_key, has_bias=False):
    """(cuda_fn, reason) for a first prompt on a fixed-capacity cache on our prefill engine
    (`_gqa_prefill_engine`): float16 / bfloat16, a head size of cuda.PREFILL_HEAD_DIMS, sm_90,
    causal or not, local windows (W > 0), head_sink / smooth softmax, softcap; no quantised cache
    or qk output (the engine has neither)."""
    c = config
    if not prefill_engine_available():
        return None, "the prefill engine runs on sm_90 (H100 / H200) only"
    checks = (
        (query.dtype not in HALF_DTYPES,
         f"a prompt in {query.dtype}: the prefill engine takes float16 and bfloat16"),
        (c.head_size not in cuda.PREFILL_HEAD_DIMS,
         f"head size {c.head_size}: the prefill engine is compiled for {cuda.PREFILL_HEAD_DIMS}"),
        (c.local_window_size == 0, "local_window_size 0 (no visible key) runs on the reference"),
        (has_bias, "attention_bias: the prefill engine has no bias"),
        (c.kv_bits, "a quantised cache: the prefill engine reads float caches"),
    ) + _prompt_shape_checks(c, query=query, key=key, past_key=past_key)
    return _route(checks, functools.partial(_gqa_prefill_engine, config=c))


def _last_keys(k, v, t, w: int):
    """(k, v, kv_len) holding the last W of each row's T_b keys, [max(0, T_b - W), T_b): the keys
    every padded row sees (L = T_b), whatever its position, which the
    engine's position-relative windows cannot say. A [B, Hkv, W, D] copy of K and V; w < 0 (no
    window, or one covering all keys): the cache as it is."""
    if w < 0:
        return k, v, t
    start = jnp.maximum(t - w, 0)  # <= C - W: T_b <= S <= C and W < S
    take = jax.vmap(lambda x, j: lax.dynamic_slice_in_dim(x, j, w, axis=1))
    return take(k, start), take(v, start), (t - start).astype(jnp.int32)


def _gqa_prefill_engine(query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache,
                        position_ids, attention_bias, head_sink, k_scale, v_scale, q_norm_weight,
                        k_norm_weight, query_seqlens, *, config):
    """A first prompt on a shared cache: gqa_prepare (the S new rows written in place at row 0; q
    comes back [B, N, S, D], the engine's layout) then the prefill engine over the whole cache
    [B, Hkv, C, D], kv_len limiting the keys (no copies of q, K or V).

    Row b has T_b = seqlens_k[b] + 1 valid keys (clipped to [0, S]: past_empty promises T_b <= S)
    and its prompt rows sit at positions 0..S-1. GQA (causal): row i < T_b sees keys j <= i; a padded
    row i >= T_b sees all T_b keys. A window W (0 < W < S) limits a row to keys [L - W, L), L =
    i + 1 (causal rows: the engine's left = W - 1) or T_b (padded rows: the last W keys,
    `_last_keys`; GQA takes a window only when causal). The engine places row i < q_len at kv_len - q_len + i, so
      - q_len = kv_len = T_b, causal: row i < T_b at position i, keys j <= i (rows >= T_b are 0);
      - the padded rows, non-causal (row order is then free): q flipped along S puts rows
        S-1 .. T_b first, q_len = S - T_b, kv_len = T_b; flipped back, they fill rows >= T_b.
        A first prompt (S == total) only: otherwise such a row is refused (one call, no flip).
    Non-causal GQA: every row sees the T_b keys, q_len = S, kv_len = T_b, one call. A refused row
    (status not OK) gives 0, as on the cuDNN route."""
    del query_seqlens, k_scale, v_scale  # not covered (the route says so)
    if attention_bias is not None:
        raise AssertionError("the prefill route excludes attention_bias")
    c = config
    n, d = c.num_heads, c.head_size
    b, s = query.shape[:2]
    q, present_k, present_v, status = _prompt_prepare(
        c, query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache, position_ids,
        q_norm_weight, k_norm_weight)
    ok = status == st.OK
    # GQA's sink: head_sink, else 0 with smooth_softmax (the decode route's rule).
    if head_sink is not None:
        sink = head_sink.astype(jnp.float32)
    elif c.smooth_softmax:
        sink = jnp.zeros((n,), jnp.float32)
    else:
        sink = None
    # T_b keys (0 for a refused row: no query row, no key); the prompt's keys are rows [0, S).
    t = jnp.where(ok, jnp.clip(seqlens_k.astype(jnp.int32) + 1, 0, s), 0).astype(jnp.int32)
    # GQA's window W: a row sees keys [L - W, L). W >= S covers every key a prompt row sees (T_b <= S).
    w = c.local_window_size if 0 < c.local_window_size < s else -1
    if c.causal:
        # L = p + 1: keys (p - W, p], the engine's left = W - 1.
        y = cuda.prefill_attention(q, present_k, present_v, t, t, sink, scale=c.scale,
                                   softcap=c.softcap, causal=True, left=w - 1 if w > 0 else -1)
        if c.first_prompt:
            # Only a first prompt has right-padded rows: in the later-step form (total = C, the
            # runtime's) a row with T_b < S starts before position 0, gqa_prepare refuses it, t = 0.
            k_all, v_all, t_all = _last_keys(present_k, present_v, t, w)
            padded = cuda.prefill_attention(jnp.flip(q, axis=2), k_all, v_all, s - t, t_all, sink,
                                            scale=c.scale, softcap=c.softcap, causal=False)
            rows = jnp.arange(s, dtype=jnp.int32)[None, None, :, None]
            y = jnp.where(rows < t[:, None, None, None], y, jnp.flip(padded, axis=2))
    else:
        # (GQA takes a window only when causal.)
        y = cuda.prefill_attention(q, present_k, present_v, jnp.full((b,), s, jnp.int32), t, sink,
                                   scale=c.scale, softcap=c.softcap, causal=False)
    y = jnp.where(ok[:, None, None, None], y, jnp.zeros_like(y))
    output = y.transpose(0, 2, 1, 3).reshape(b, s, n * d)
    return output, present_k, present_v, None, status


# --- ai.onnx Attention prompts on the prefill engine ---------------------------------------------

def attention_prefill_route(attrs: dict, *, return_qk: bool, q, present_key, present_value,
                            cache: str = "none", new_rows: int | None = None,
                            has_mask: bool = False):
    """(cuda_fn, reason) for an ai.onnx Attention call of more than MAX_QUERY_ROWS query rows on our
    prefill engine (`_attention_prefill`), where the engine computes it exactly: sm_90 with
    JOA_PREFILL_ENGINE on, float16 / bfloat16 Q, K and V of one dtype, a head size of
    cuda.PREFILL_HEAD_DIMS shared by V, no attn_mask, no qk output, a float32 softmax, and query
    positions the engine's bottom-right rule can place (`_prefill_kv_rows`).

    Arguments as in `attention_cuda`.
    """
    if not prefill_engine_available():
        return None, "the prefill engine runs on sm_90 (H100 / H200) only"
    if not prefill_engine_enabled():
        return None, f"{PREFILL_ENGINE_ENV}=0 keeps prompts off the prefill engine"
    softmax = attrs["softmax_dtype"]  # `is None`: numpy's dtype == None is float64
    d = q.shape[-1]
    kv_rows, position_why = _prefill_kv_rows(attrs, q.shape[2], present_key.shape[2], cache,
                                             new_rows)
    checks = (
        (q.dtype not in HALF_DTYPES,
         f"Q is {q.dtype}: the prefill engine takes float16 and bfloat16"),
        (not present_key.dtype == q.dtype == present_value.dtype,
         f"V is {present_value.dtype} and Q {q.dtype}: the prefill engine takes one dtype"),
        (d not in cuda.PREFILL_HEAD_DIMS,
         f"head size {d}: the prefill engine is compiled for {cuda.PREFILL_HEAD_DIMS}"),
        (present_value.shape[-1] != d,
         f"V's head size {present_value.shape[-1]} differs from Q's {d}: the prefill engine "
         f"takes Dv = D"),
        (return_qk, "qk_matmul_output: the prefill engine has no qk output"),
        (softmax is not None and softmax != jnp.float32,
         f"softmax_precision {softmax}: the prefill engine runs the softmax in float32"),
        (has_mask, "attn_mask: the prefill engine takes no mask"),
        (position_why, None),
    )
    return _route(checks, functools.partial(
        _attention_prefill, scale=attrs["scale"], softcap=attrs["softcap"],
        causal=attrs["is_causal"], left=attrs["left_window_size"],
        right=attrs["right_window_size"], kv_rows=kv_rows))


def _prefill_kv_rows(attrs, s: int, t: int, cache: str, new_rows: int | None):
    """(kv_rows, None): the engine's kv_len (None: nonpad_kv_seqlen, per batch row) with q_len = S;
    or (None, reason) where the engine cannot place the rows as the spec does.

    The spec puts query row i at position i + offset (offset P with past, nonpad[b] - S with
    nonpad, else 0) and lets it see keys j < T (j < nonpad[b]); the engine puts it at
    kv_len - q_len + i and lets it see keys j < kv_len. With q_len = S:
      - no causal and no window: positions do not matter; kv_len = T (nonpad[b]);
      - nonpad: kv_len = nonpad[b] is the spec's offset + S and its key limit (bottom-right per
        batch row; a nonpad[b] above T is clamped to T, as on the decode kernels);
      - past / no cache: kv_len = offset + S, which is T when S = L (a prompt after a past, or a
        plain S x S prompt). With S < L the keys [offset + S, T) that the engine then hides are
        hidden by the spec only when no row sees past its own position (causal, or
        right_window_size 0): then the rule is exact, top-left included (no cache: offset 0).
        S > L would need kv_len > T.
    """
    causal, left, right = attrs["is_causal"], attrs["left_window_size"], attrs["right_window_size"]
    if not causal and left < 0 and right < 0:
        return (None if cache == "nonpad" else t), None
    if cache == "nonpad":
        return None, None
    l = t if new_rows is None else new_rows
    offset = t - l if cache == "past" else 0
    if s == l or (s < l and (causal or right == 0)):
        return offset + s, None
    where = f"past {offset}" if cache == "past" else "no cache"
    if s > l:
        return None, (f"{s} query rows over {l} new keys ({where}): the prefill engine's "
                      f"bottom-right positions cannot place them")
    return None, (f"{s} query rows over {l} new keys ({where}) without causal or "
                  f"right_window_size 0: the spec's rows see keys the prefill engine's "
                  f"bottom-right rule would place past them")


def _attention_prefill(q, k, v, attn_mask, past_key, past_value, nonpad, *, scale, softcap,
                       causal, left, right, kv_rows):
    """An ai.onnx Attention prompt on the prefill engine: present = concat(past, new) (new outputs:
    an XLA concatenation), then one engine call over it, q_len = S and kv_len = kv_rows, or
    nonpad_kv_seqlen (`_prefill_kv_rows`). Rows that see no key are 0, as the spec's fully masked
    rows. -> (y, present_key, present_value, None), the reference's results without qk."""
    if attn_mask is not None:
        raise AssertionError("the Attention prefill route excludes attn_mask")
    if past_key is not None:
        k = jnp.concatenate([past_key, k], axis=2)
        v = jnp.concatenate([past_value, v], axis=2)
    b, s = q.shape[0], q.shape[2]
    q_len = jnp.full((b,), s, jnp.int32)
    kv_len = nonpad.astype(jnp.int32) if kv_rows is None else jnp.full((b,), kv_rows, jnp.int32)
    y = cuda.prefill_attention(q, k, v, q_len, kv_len, None, scale=scale, softcap=softcap,
                               causal=causal, left=left, right=right)
    return y, k, v, None
