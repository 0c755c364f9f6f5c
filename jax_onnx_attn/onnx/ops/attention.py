"""Attention-family ops: ai.onnx Attention (23-25), com.microsoft GroupQueryAttention, and the rotary
embeddings (ai.onnx RotaryEmbedding-23, com.microsoft RotaryEmbedding).

ONNX attribute names are the keyword names of `jax_onnx_attn.ops.attention` and
`jax_onnx_attn.ops.group_query_attention`, so attributes pass through unchanged.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_onnx_attn import ops
from jax_onnx_attn.onnx.registry import MS_DOMAIN, register
from jax_onnx_attn.onnx.values import to_jax
from jax_onnx_attn.ops.reference.rotary import rotary_embedding

ATTENTION_ATTRS = ("is_causal", "scale", "softcap", "q_num_heads", "kv_num_heads",
                   "qk_matmul_output_mode", "softmax_precision", "left_window_size",
                   "right_window_size")
GQA_INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k",
              "total_sequence_length", "cos_cache", "sin_cache", "position_ids", "attention_bias",
              "head_sink", "k_scale", "v_scale", "q_norm_weight", "k_norm_weight", "query_seqlens")
GQA_ATTRS = ("num_heads", "kv_num_heads", "scale", "softcap", "local_window_size", "do_rotary",
             "rotary_interleaved", "smooth_softmax", "qk_output", "causal", "sliding_window_cache",
             "k_quant_type", "v_quant_type", "kv_cache_bit_width", "qk_norm_epsilon",
             "q_norm_epsilon", "k_norm_epsilon")


def _known_attrs(ctx, names) -> dict:
    unknown = sorted(set(ctx.attrs) - set(names))
    if unknown:
        ctx.fail(f"attribute(s) {unknown} are not supported", NotImplementedError)
    return dict(ctx.attrs)


def _wants(ctx, index: int) -> bool:
    return len(ctx.node.output) > index and bool(ctx.node.output[index])


def unexpanded_kv(ctx, index: int):
    """K or V with torch's repeat_kv undone, else the input as it is.

    torch exports expand K/V [B, Hkv, T, D] to the query heads before Attention as
    Reshape(Expand(Unsqueeze(kv, axes=[2]), [B, Hkv, G, T, D]), [B, Hkv*G, T, D]). Query head h then
    reads KV head h // G, which is exactly Attention's own GQA mapping, so the op can take the
    Hkv-head tensor directly: XLA drops the unused expansion and the kernel reads G times less KV.
    """
    name = ctx.node.input[index]
    value = ctx.value(name)
    rs = ctx.producer(name)
    if value is None or value.ndim != 4 or rs is None or rs.op_type != "Reshape":
        return value
    ex = ctx.producer(rs.input[0])
    if ex is None or ex.op_type != "Expand":
        return value
    un = ctx.producer(ex.input[0])
    if un is None or un.op_type not in ("Unsqueeze", "Reshape"):
        return value
    src, expanded = ctx.value(un.input[0]), ctx.value(ex.output[0])
    if src is None or getattr(src, "ndim", 0) != 4 or expanded is None or expanded.ndim != 5:
        return value
    b, hkv, t, d = src.shape
    g = expanded.shape[2]
    if (ctx.value(un.output[0]).shape == (b, hkv, 1, t, d) and expanded.shape == (b, hkv, g, t, d)
            and value.shape == (b, hkv * g, t, d)):
        return src
    return value


def run_attention(ctx, Q, K, V, attn_mask=None, past_key=None, past_value=None,
                  nonpad_kv_seqlen=None, *, overrides: dict | None = None):
    """ai.onnx Attention through `ops.attention` (K/V un-expanded where torch repeated them).

    overrides: attributes to replace (the cache step turns is_causal off and passes its own mask).
    """
    attrs = {**_known_attrs(ctx, ATTENTION_ATTRS), **(overrides or {})}
    if K is not None and past_key is None:
        K, V = unexpanded_kv(ctx, 1), unexpanded_kv(ctx, 2)
    args = [to_jax(v) for v in (Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen)]
    res = ops.attention(*args, **attrs, opset=ctx.interp.opsets[""], return_qk=_wants(ctx, 3))
    return res.y, res.present_key, res.present_value, res.qk


register("Attention", 23, 24, 25)(run_attention)


def run_gqa(ctx, inputs, *, shared_buffer: bool = False):
    """com.microsoft GroupQueryAttention through `ops.group_query_attention`.

    shared_buffer=False is onnxruntime's default run (present = a new buffer of max(total, P) rows);
    the fixed-capacity cache step passes True (past and present are one buffer, written in place).
    """
    if len(inputs) > len(GQA_INPUTS):
        ctx.fail(f"has {len(inputs)} inputs; the supported schema has {len(GQA_INPUTS)}")
    attrs = _known_attrs(ctx, GQA_ATTRS)
    kwargs = {}
    for name, v in zip(GQA_INPUTS, inputs):
        if v is not None:
            # total_sequence_length sets shapes: the op wants it static (it is Shape arithmetic in
            # every producer's graph); everything else goes to the device.
            kwargs[name] = np.asarray(v) if name == "total_sequence_length" and \
                isinstance(v, (np.ndarray, np.generic)) else to_jax(v)
    res = ops.group_query_attention(**kwargs, **attrs, shared_buffer=shared_buffer)
    return res.output, res.present_key, res.present_value, res.output_qk


@register("GroupQueryAttention", 1, domain=MS_DOMAIN)
def group_query_attention(ctx, *inputs):
    return run_gqa(ctx, inputs)


def _rotary(x, cos, sin, positions, *, interleaved: bool, rotary_dim: int, num_heads: int | None,
            fail):
    """Rotary on a 4D [B, H, S, D] or 3D [B, S, H*D] tensor (the 3D form needs num_heads)."""
    x = to_jax(x)
    if x.ndim == 3:
        if not num_heads:
            fail("num_heads is required for a 3D input")
        b, s, hidden = x.shape
        x4 = x.reshape(b, s, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)
    elif x.ndim == 4:
        x4 = x
    else:
        fail(f"input must be 3D or 4D, got shape {list(x.shape)}")
    # rotary_embedding_dim 0 = the width the cos/sin tables cover (the whole head when full).
    y = rotary_embedding(x4, to_jax(cos), to_jax(sin), positions, interleaved=bool(interleaved),
                         rotary_dim=rotary_dim or None)
    if x.ndim == 3:
        y = y.transpose(0, 2, 1, 3).reshape(x.shape)
    return y


@register("RotaryEmbedding", 23)
def rotary_onnx(ctx, x, cos_cache, sin_cache, position_ids=None):
    """ai.onnx RotaryEmbedding-23: cos/sin [max_pos, R/2] read at position_ids [B, S], or per-token
    [B, S, R/2] without position_ids. rotary_embedding_dim 0 means the whole head."""
    return _rotary(x, cos_cache, sin_cache, None if position_ids is None else to_jax(position_ids),
                   interleaved=ctx.attr("interleaved", 0),
                   rotary_dim=ctx.attr("rotary_embedding_dim", 0), num_heads=ctx.attr("num_heads"),
                   fail=ctx.fail)


@register("RotaryEmbedding", 1, domain=MS_DOMAIN)
def rotary_ms(ctx, x, position_ids, cos_cache, sin_cache):
    """com.microsoft RotaryEmbedding: position_ids [B, S], or [1] = the offset of positions 0..S-1."""
    if ctx.attr("is_packed_batching", 0):
        ctx.fail("is_packed_batching=1 is not supported", NotImplementedError)
    if ctx.attr("scale", 1.0) != 1.0:
        ctx.fail("scale != 1 is not supported", NotImplementedError)
    pos = to_jax(position_ids)
    s = x.shape[1] if x.ndim == 3 else x.shape[2]
    if pos.ndim == 1:
        pos = (pos.reshape(1, 1) + jnp.arange(s, dtype=pos.dtype)[None, :])
    return _rotary(x, cos_cache, sin_cache, pos, interleaved=ctx.attr("interleaved", 0),
                   rotary_dim=ctx.attr("rotary_embedding_dim", 0), num_heads=ctx.attr("num_heads"),
                   fail=ctx.fail)
