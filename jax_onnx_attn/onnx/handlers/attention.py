"""Attention-family ops: ai.onnx Attention (23-25), com.microsoft GroupQueryAttention, and the rotary
embeddings (ai.onnx RotaryEmbedding-23, com.microsoft RotaryEmbedding).

ONNX attribute names are the keyword names of `jax_onnx_attn.ops.attention` and
`jax_onnx_attn.ops.group_query_attention`, so attributes pass through unchanged.

Handlers: `(ctx, *inputs) -> outputs`, per their @register op's ONNX schema (see `onnx.handlers`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jax_onnx_attn import ops
from jax_onnx_attn.onnx.registry import MS_DOMAIN, register
from jax_onnx_attn.onnx.values import attribute_value, to_jax
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


def known_attrs(ctx, names) -> dict:
    """The node's attributes as a dict; NotImplementedError (naming the node) for any not in `names`."""
    unknown = sorted(set(ctx.attrs) - set(names))
    if unknown:
        ctx.fail(f"attribute(s) {unknown} are not supported", NotImplementedError)
    return dict(ctx.attrs)


def repeat_kv_source(ctx, name: str):
    """(kv [B, Hkv, T, D], G) when the value `name` is torch's repeat_kv of kv, else None.

    torch exports expand K/V [B, Hkv, T, D] to the query heads as
    Reshape(Expand(Unsqueeze(kv, axes=[2]), [B, Hkv, G, T, D]), [B, Hkv*G, T, D]): query head h
    reads KV head h // G.
    """
    value = ctx.value(name)
    rs = ctx.producer(name)
    if getattr(value, "ndim", 0) != 4 or rs is None or rs.op_type != "Reshape":
        return None
    ex = ctx.producer(rs.input[0])
    if ex is None or ex.op_type != "Expand":
        return None
    un = ctx.producer(ex.input[0])
    if un is None or un.op_type not in ("Unsqueeze", "Reshape"):
        return None
    src, unsq, expanded = ctx.value(un.input[0]), ctx.value(un.output[0]), ctx.value(ex.output[0])
    if getattr(src, "ndim", 0) != 4 or getattr(expanded, "ndim", 0) != 5:
        return None
    b, hkv, t, d = src.shape
    g = expanded.shape[2]
    if (unsq.shape == (b, hkv, 1, t, d) and expanded.shape == (b, hkv, g, t, d)
            and value.shape == (b, hkv * g, t, d)):
        return src, g
    return None


def unexpanded_kv(ctx, index: int):
    """K or V with torch's repeat_kv undone, else the input as it is.

    Query head h of the expanded tensor reads KV head h // G, which is exactly Attention's own GQA
    mapping, so the op can take the Hkv-head tensor directly: XLA drops the unused expansion and
    the kernel reads G times less KV.
    """
    found = repeat_kv_source(ctx, ctx.node.input[index])
    return ctx.value(ctx.node.input[index]) if found is None else found[0]


class GroupedKV(NamedTuple):
    """A MatMul operand that is repeat_kv(kv) seen through head-preserving steps (see grouped_kv)."""
    kv: object           # [B, Hkv, T, D], before the expansion
    groups: int          # G = query heads per KV head
    transposed: bool     # the operand is [B, Hkv*G, D, T] (K^T of a decomposed attention)
    scales: tuple        # scalars (static or traced) the operand was multiplied by

    def operand(self):
        """The operand with its Hkv heads only: [B, Hkv, T, D] (or D, T), scaled."""
        kv = to_jax(self.kv)
        for c in self.scales:
            kv = kv * to_jax(c).astype(kv.dtype)
        return jnp.swapaxes(kv, -1, -2) if self.transposed else kv


#: Steps between repeat_kv and the attention MatMul of a decomposed export, at most this many.
_MAX_KV_STEPS = 8


def grouped_kv(ctx, index: int) -> GroupedKV | None:
    """Operand `index` of a 4-D MatMul as torch's repeat_kv of an Hkv-head K or V, or None.

    torch's decomposed attention (opset < 23) reads the expanded K as Mul(Reshape(Transpose(
    Reshape(repeat_kv(K), [B*Hq, T, D]), [0, 2, 1]), [B, Hq, D, T]), sqrt(scale)) and V as
    repeat_kv(V). Allowed steps: Reshape that regroups only the leading (batch, head) axes, Transpose
    that swaps the last two axes, Mul by a scalar. The operand must end as [B, Hq, T, D] or
    [B, Hq, D, T], head h of it being KV head h // G.
    """
    name = ctx.node.input[index]
    target = ctx.value(name)
    if getattr(target, "ndim", 0) != 4:
        return None
    transposed, scales = False, []
    for _ in range(_MAX_KV_STEPS):
        found = repeat_kv_source(ctx, name)
        if found is not None:
            break
        node = ctx.producer(name)
        if node is None or not node.input:
            return None
        out = ctx.value(node.output[0])
        if node.op_type == "Mul" and len(node.input) == 2:
            # A scalar factor (torch's sqrt(scale), a static value or a weight) commutes with
            # the expansion: it is applied to the Hkv heads instead.
            sizes = [getattr(ctx.value(i), "size", None) for i in node.input]
            if 1 not in sizes:
                return None
            factor, other = (node.input[sizes.index(1)], node.input[1 - sizes.index(1)])
            factor = ctx.value(factor)
            if (getattr(ctx.value(other), "shape", None) != out.shape
                    or not jnp.issubdtype(factor.dtype, jnp.floating)):
                return None
            scales.append(factor.reshape(()))
            name = other
            continue
        x = ctx.value(node.input[0])
        if getattr(x, "ndim", 0) < 3:
            return None
        if node.op_type == "Transpose":
            n = x.ndim
            perm = next((list(attribute_value(a)) for a in node.attribute if a.name == "perm"),
                        list(range(n - 1, -1, -1)))
            if perm[:-2] != list(range(n - 2)) or perm[-2:] not in ([n - 2, n - 1], [n - 1, n - 2]):
                return None
            transposed ^= perm[-2:] == [n - 1, n - 2]
        elif node.op_type == "Reshape":
            if tuple(x.shape[-2:]) != tuple(out.shape[-2:]):
                return None  # only the leading (batch, head) axes may be regrouped
        else:
            return None
        name = node.input[0]
    else:
        return None
    kv, g = found
    b, hkv, t, d = kv.shape
    want = (b, hkv * g, d, t) if transposed else (b, hkv * g, t, d)
    if tuple(target.shape) != want:
        return None
    return GroupedKV(kv, g, transposed, tuple(scales))


def run_attention(ctx, Q, K, V, attn_mask=None, past_key=None, past_value=None,
                  nonpad_kv_seqlen=None, *, overrides: dict | None = None):
    """ai.onnx Attention through `ops.attention` (K/V un-expanded where torch repeated them).

    Args (the ONNX Attention inputs, NumPy or jax; shapes and dtypes as in `ops.attention`):
      ctx: the node's NodeContext (attributes, opset).
      Q: [B, Hq, S, D] or [B, S, Hq·D] float; K: [B, Hkv, L, D] or [B, L, Hkv·D] of Q's dtype;
        V: [B, Hkv, L, Dv] or [B, L, Hkv·Dv] float.
      attn_mask: bool / int / float, rank 1-4, broadcast to [B, Hq, S, P + L]; or None.
      past_key, past_value: [B, Hkv, P, D] / [B, Hkv, P, Dv], or None.
      nonpad_kv_seqlen: integer [B], or None.
      overrides: attributes to replace (the cache step turns is_causal off and passes its own mask).

    Returns:
      (y, present_key, present_value, qk): y has Q's layout and dtype; qk [B, Hq, S, P + L] is None
      unless the node wants output 3.
    """
    attrs = {**known_attrs(ctx, ATTENTION_ATTRS), **(overrides or {})}
    if K is not None and past_key is None:
        K, V = unexpanded_kv(ctx, 1), unexpanded_kv(ctx, 2)
    args = [to_jax(v) for v in (Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen)]
    res = ops.attention(*args, **attrs, opset=ctx.interp.opsets[""], return_qk=ctx.wants(3))
    return res.y, res.present_key, res.present_value, res.qk


register("Attention", 23, 24, 25)(run_attention)


def run_gqa(ctx, inputs, *, shared_buffer: bool = False, overrides: dict | None = None,
            statuses: list | None = None, past_empty: bool = False):
    """com.microsoft GroupQueryAttention through `ops.group_query_attention`.

    shared_buffer=False is onnxruntime's default run (present = a new buffer of max(total, P) rows);
    the fixed-capacity cache step passes True (past and present are one buffer, written in place).
    overrides: attributes to replace (the cache step turns sliding_window_cache off).
    statuses: a list that gets the op's int32 [B] device status appended (the cache step collects
      them; an ONNX graph has no output for it).
    past_empty: the cache step's promise that no row has a past (its first prompt): see
      `ops.group_query_attention`.

    Args:
      ctx: the node's NodeContext.
      inputs: the node's inputs in GQA_INPUTS order (None where omitted), shapes and dtypes as in
        `ops.group_query_attention`: query [B, S, N·D] (or packed [B, S, (N + 2·Hkv)·D]) float;
        key / value [B, S, Hkv·D]; past_key / past_value [B, Hkv, P, D]; seqlens_k int32 [B];
        total_sequence_length int32 scalar (static); cos_cache / sin_cache [max_pos, R/2]; ...

    Returns:
      (output [B, S, N·D], present_key, present_value [B, Hkv, P', D], output_qk or None).
    """
    if len(inputs) > len(GQA_INPUTS):
        ctx.fail(f"has {len(inputs)} inputs; the supported schema has {len(GQA_INPUTS)}")
    attrs = {**known_attrs(ctx, GQA_ATTRS), **(overrides or {})}
    kwargs = {}
    for name, v in zip(GQA_INPUTS, inputs):
        if v is not None:
            # total_sequence_length sets shapes: the op wants it static (it is Shape arithmetic in
            # every producer's graph); everything else goes to the device.
            kwargs[name] = np.asarray(v) if name == "total_sequence_length" and \
                isinstance(v, (np.ndarray, np.generic)) else to_jax(v)
    res = ops.group_query_attention(**kwargs, **attrs, shared_buffer=shared_buffer,
                                    past_empty=past_empty,
                                    query_projection=query_projection(ctx, inputs))
    if statuses is not None:
        statuses.append(res.status)
    return res.output, res.present_key, res.present_value, res.output_qk


def query_projection(ctx, inputs) -> ops.QkvProjection | None:
    """The packed query of this GroupQueryAttention as the projection that made it, when that is a
    Linear in the rotary-pair order (`onnx.fusion` pass 5: attribute qkv_pairs) with dense weights
    or 4-bit ones in the record layout; else None."""
    from jax_onnx_attn.onnx.fusion import JOA_DOMAIN, LINEAR_INPUTS

    if not ctx.node.input or len(inputs) > 1 and inputs[1] is not None:
        return None
    lin = ctx.producer(ctx.node.input[0])
    if lin is None or lin.op_type != "Linear" or lin.domain != JOA_DOMAIN:
        return None
    attrs = {a.name: attribute_value(a) for a in lin.attribute}
    bits = int(attrs.get("bits", 0))
    layout = attrs.get("layout", "nk" if not bits else "onnx")
    if "qkv_pairs" not in attrs or (bits, layout) not in ((0, "nk"), (4, "record")):
        return None
    names = dict(zip(LINEAR_INPUTS, list(lin.input) + [""] * len(LINEAR_INPUTS)))
    value = {k: None if not n else to_jax(ctx.value(n)) for k, n in names.items()}
    return ops.QkvProjection(value["x"], value["w"], value["bias"], value["norm_weight"],
                             float(attrs.get("norm_epsilon", 1e-6)), bits or 16,
                             int(attrs.get("block_size", 0)), int(attrs["qkv_pairs"][3]))


@register("GroupQueryAttention", 1, domain=MS_DOMAIN)
def group_query_attention(ctx, *inputs):
    """com.microsoft GroupQueryAttention-1 (onnxruntime's default, non-shared present buffer); its
    int32 [B] status goes to `LoweredModel.apply_with_status`."""
    statuses: list = []
    out = run_gqa(ctx, inputs, statuses=statuses)
    ctx.report_status(statuses[0])
    return out


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
