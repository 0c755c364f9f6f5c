"""ai.onnx Attention (opsets 23, 24, 25) as a JAX op, plus a fixed-capacity KV-cache form for decoding.

`attention` takes the operator's inputs and attributes under their ONNX names, validates them at trace
time (a ValueError / TypeError naming the input and the rule), normalises 3D inputs and the mask to
the BHSD layout and dispatches to a backend. The reference backend (`ops.reference.attention`) is the
spec; CUDA kernels plug into the same call with the same arguments.

`attention_with_cache` is the decoding form: past K/V live in [B, Hkv, C, D] buffers of fixed capacity
C with a per-batch valid length on the device. It is ONNX's external-cache use (opset 24) spelled out:
append the new rows at `cache_lengths[b]` with `kv_append`, then attend over the whole buffer with
`nonpad_kv_seqlen = cache_lengths + S`. Shapes never grow, so one compiled decode step serves every
token.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.ops import decode_paths, partitioning
from jax_onnx_attn.ops import status as st
from jax_onnx_attn.ops.backend import check_backend, dispatch
from jax_onnx_attn.ops.dtypes import check_float_dtype, lengths_int32
from jax_onnx_attn.ops.kv_cache import kv_append
from jax_onnx_attn.ops.reference import attention as reference

_OP = "attention"

#: softmax_precision as the ONNX TensorProto enum: FLOAT, FLOAT16, DOUBLE, BFLOAT16.
SOFTMAX_PRECISIONS = {1: jnp.dtype(jnp.float32), 10: jnp.dtype(jnp.float16),
                      11: jnp.dtype(jnp.float64), 16: jnp.dtype(jnp.bfloat16)}
#: The ai.onnx opsets that define Attention; a newer model opset resolves to the latest of them.
MIN_OPSET = 23


class AttentionOutputs(NamedTuple):
    """Outputs of `attention`, in the ONNX output order.

    y: [B, Hq, S, Dv] (4D inputs) or [B, S, Hq * Dv] (3D inputs), dtype of Q.
    present_key: [B, Hkv, P + L, D], dtype of K (always 4D; equals K when there is no past).
    present_value: [B, Hkv, P + L, Dv], dtype of V.
    qk: [B, Hq, S, P + L] in Q's dtype as selected by qk_matmul_output_mode, or None unless
      return_qk=True.
    """

    y: jax.Array
    present_key: jax.Array
    present_value: jax.Array
    qk: Optional[jax.Array]


class CachedAttentionOutputs(NamedTuple):
    """Outputs of `attention_with_cache`.

    y: as in `AttentionOutputs.y`.
    key_cache, value_cache: the updated [B, Hkv, C, D] / [B, Hkv, C, Dv] buffers (written in place
      when the caller donates them).
    cache_lengths: int32 [B], the valid length after this step (unchanged for a skipped row).
    status: int32 [B] (`jax_onnx_attn.ops.status`): KV_WRITE_OUT_OF_RANGE where length + S > C; that
      row's K/V were not written and its y is 0.
    qk: [B, Hq, S, C] in Q's dtype, or None unless return_qk=True.
    """

    y: jax.Array
    key_cache: jax.Array
    value_cache: jax.Array
    cache_lengths: jax.Array
    status: jax.Array
    qk: Optional[jax.Array]


def _error(message: str, kind=ValueError):
    return kind(f"{_OP}: {message}")


def _shape(x) -> str:
    return "[" + ", ".join(str(d) for d in x.shape) + "]"


# ---------------------------------------------------------------------------------------------------
# Attribute validation (all static, all at trace time)
# ---------------------------------------------------------------------------------------------------

def _check_int_attr(name: str, value, allowed=None, minimum=None) -> int:
    if isinstance(value, (bool, np.bool_)):
        value = int(value)
    if not isinstance(value, (int, np.integer)):
        raise _error(f"attribute {name} must be an int, got {value!r}", TypeError)
    value = int(value)
    if allowed is not None and value not in allowed:
        raise _error(f"attribute {name} must be one of {sorted(allowed)}, got {value}")
    if minimum is not None and value < minimum:
        raise _error(f"attribute {name} must be -1 or >= 0, got {value}")
    return value


def _softmax_dtype(softmax_precision):
    """The dtype of `softmax_precision` (TensorProto enum or a dtype), canonicalised for jax_enable_x64
    (DOUBLE runs in float32 when 64-bit types are off: the widest the process has)."""
    if softmax_precision is None:
        return None
    if isinstance(softmax_precision, (int, np.integer)) and not isinstance(softmax_precision, bool):
        if int(softmax_precision) not in SOFTMAX_PRECISIONS:
            raise _error(f"softmax_precision must be one of {sorted(SOFTMAX_PRECISIONS)} (FLOAT, "
                         f"FLOAT16, DOUBLE, BFLOAT16), got {softmax_precision}")
        dtype = SOFTMAX_PRECISIONS[int(softmax_precision)]
    else:
        try:
            dtype = jnp.dtype(softmax_precision)
        except TypeError:
            raise _error(f"softmax_precision must be a TensorProto enum or a float dtype, got "
                         f"{softmax_precision!r}", TypeError) from None
        if dtype not in SOFTMAX_PRECISIONS.values():
            raise _error("softmax_precision must be float16, bfloat16, float32 or float64, got "
                         f"{dtype}")
    return jnp.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _check_attributes(*, is_causal, scale, softcap, qk_matmul_output_mode, softmax_precision,
                      left_window_size, right_window_size, opset: int):
    """Validated static attributes (scale left for later: it needs D)."""
    is_causal = _check_int_attr("is_causal", is_causal, allowed={0, 1})
    mode = _check_int_attr("qk_matmul_output_mode", qk_matmul_output_mode, allowed={0, 1, 2, 3})
    left = _check_int_attr("left_window_size", left_window_size, minimum=-1)
    right = _check_int_attr("right_window_size", right_window_size, minimum=-1)
    if (left != -1 or right != -1) and opset < 25:
        raise _error(f"left_window_size / right_window_size need opset >= 25, got opset={opset}")
    try:
        softcap = float(softcap if softcap is not None else 0.0)
    except TypeError:
        raise _error(f"attribute softcap must be a float, got {softcap!r}", TypeError) from None
    if not math.isfinite(softcap) or softcap < 0:
        raise _error(f"attribute softcap must be finite and >= 0 (0 = off), got {softcap}")
    if scale is not None:
        try:
            scale = float(scale)
        except TypeError:
            raise _error(f"attribute scale must be a float, got {scale!r}", TypeError) from None
        if not math.isfinite(scale):
            raise _error(f"attribute scale must be finite, got {scale}")
    return dict(is_causal=bool(is_causal), scale=scale, softcap=softcap, qk_matmul_output_mode=mode,
                softmax_dtype=_softmax_dtype(softmax_precision), left_window_size=left,
                right_window_size=right)


# ---------------------------------------------------------------------------------------------------
# Input normalisation
# ---------------------------------------------------------------------------------------------------

def _to_bhsd(Q, K, V, q_num_heads, kv_num_heads, *, heads_allowed_4d: bool):
    """3D [B, S, H*d] -> 4D [B, H, S, d] by rank; returns (q, k, v, is_3d)."""
    for name, x in (("Q", Q), ("K", K), ("V", V)):
        if x.ndim not in (3, 4):
            raise _error(f"{name} must be 3D [B, S, hidden] or 4D [B, H, S, D], got shape {_shape(x)}")
    if not Q.ndim == K.ndim == V.ndim:
        raise _error(f"Q, K and V must have the same rank, got {Q.ndim}, {K.ndim} and {V.ndim}")
    heads = {"q_num_heads": q_num_heads, "kv_num_heads": kv_num_heads}
    for name, h in heads.items():
        if h is not None:
            h = _check_int_attr(name, h)
            if h < 1:
                raise _error(f"attribute {name} must be >= 1, got {h}")
            heads[name] = h
    if Q.ndim == 4:
        given = {n: h for n, h in heads.items() if h is not None}
        if given and not heads_allowed_4d:
            raise _error(f"{', '.join(given)} must not be given for 4D inputs (opset >= 25)")
        actual = {"q_num_heads": Q.shape[1], "kv_num_heads": K.shape[1]}
        for name, h in given.items():
            if h != actual[name]:
                raise _error(f"attribute {name}={h} disagrees with the 4D input's head count "
                             f"{actual[name]}")
        return Q, K, V, False
    if heads["q_num_heads"] is None or heads["kv_num_heads"] is None:
        raise _error("3D inputs need both q_num_heads and kv_num_heads")

    def split(name, x, h, heads_attr):
        b, s, hidden = x.shape
        if hidden % h:
            raise _error(f"{name} hidden size {hidden} is not divisible by {heads_attr}={h}")
        return x.reshape(b, s, h, hidden // h).transpose(0, 2, 1, 3)

    return (split("Q", Q, heads["q_num_heads"], "q_num_heads"),
            split("K", K, heads["kv_num_heads"], "kv_num_heads"),
            split("V", V, heads["kv_num_heads"], "kv_num_heads"), True)


def _check_qkv(q, k, v):
    """Shapes and dtypes of BHSD q [B, Hq, S, D], k [B, Hkv, L, D], v [B, Hkv, L, Dv]."""
    check_float_dtype(_OP, "Q", q.dtype)
    check_float_dtype(_OP, "V", v.dtype)
    if k.dtype != q.dtype:
        raise _error(f"K has dtype {k.dtype} but Q has {q.dtype} (both are T1)", TypeError)
    b, hq, _, d = q.shape
    if d == 0:
        raise _error(f"Q head size must be >= 1 (scale is 1/sqrt(D)), got Q shape {_shape(q)}")
    if k.shape[1] == 0:
        raise _error(f"K must have at least one head, got K shape {_shape(k)}")
    if k.shape[0] != b or v.shape[0] != b:
        raise _error(f"batch sizes differ: Q {q.shape[0]}, K {k.shape[0]}, V {v.shape[0]}")
    if k.shape[3] != d:
        raise _error(f"K head size {k.shape[3]} differs from Q head size {d}")
    if v.shape[1] != k.shape[1]:
        raise _error(f"V has {v.shape[1]} heads but K has {k.shape[1]}")
    if v.shape[2] != k.shape[2]:
        raise _error(f"V has sequence length {v.shape[2]} but K has {k.shape[2]}")
    if hq % k.shape[1]:
        raise _error(f"query heads {hq} are not a multiple of KV heads {k.shape[1]} (Hq % Hkv != 0)")


def _check_pair(name: str, x, like, what: str):
    """A cache-like input: 4D [B, Hkv, *, d] with the dtype of `like` ([B, Hkv, L, d])."""
    if x.ndim != 4:
        raise _error(f"{name} must be 4D [B, Hkv, {what}, d], got shape {_shape(x)}")
    if x.dtype != like.dtype:
        raise _error(f"{name} has dtype {x.dtype} but must match {like.dtype}", TypeError)
    if (x.shape[0], x.shape[1], x.shape[3]) != (like.shape[0], like.shape[1], like.shape[3]):
        raise _error(f"{name} shape {_shape(x)} does not match [B, Hkv, {what}, d] = "
                     f"[{like.shape[0]}, {like.shape[1]}, {what}, {like.shape[3]}]")


def _check_lengths(name: str, x, batch: int):
    """An integer [B] length tensor as int32, saturated (`dtypes.lengths_int32`): a 64-bit value
    out of range stays out of range instead of wrapping."""
    if not hasattr(x, "dtype"):
        x = np.asarray(x)
    if np.ndim(x) != 1 or x.shape[0] != batch:
        raise _error(f"{name} must have shape [B] = [{batch}], got {_shape(x)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise _error(f"{name} must be an integer tensor, got {x.dtype}", TypeError)
    return lengths_int32(x)


def _normalise_mask(mask, target: tuple, *, short_ok: bool, total_name: str, short_rule: str):
    """Rank 1-4 mask -> rank 4, right-aligned against target (B, Hq, S, T); rank 3 is (Hq, S, T).

    Every dim must be 1 or the target's; the last may also be shorter than T (padded later with
    -inf / False; a last dim of 1 is padded, not broadcast, as in the ONNX reference).
    """
    if mask.ndim < 1 or mask.ndim > 4:
        raise _error(f"attn_mask must have rank 1 to 4 (broadcast to [B, Hq, S, T]), got shape "
                     f"{_shape(mask)}")
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)
            or jnp.issubdtype(mask.dtype, jnp.floating)):
        raise _error(f"attn_mask must be bool, integer or float, got {mask.dtype}", TypeError)
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    names = ("batch", "heads", "query", "key")
    for axis in range(3):
        if shape[axis] not in (1, target[axis]):
            raise _error(f"attn_mask shape {_shape(mask)} does not broadcast to [B, Hq, S, T] = "
                         f"{list(target)}: its {names[axis]} dim is {shape[axis]}, not 1 or "
                         f"{target[axis]}")
    last, total = shape[3], target[3]
    if last > total:
        raise _error(f"attn_mask last dim {last} is longer than {total_name} {total}")
    if last < total and not short_ok:
        raise _error(f"attn_mask last dim {last} is shorter than {total_name} {total}; "
                     f"{short_rule}")
    return mask.reshape(shape)


def _mask_array(mask):
    """attn_mask as a jax array; a 64-bit integer mask from the host becomes float32 (it is added
    as numbers either way), so that its values are not wrapped into 32 bits."""
    if not isinstance(mask, jax.Array):
        mask = np.asarray(mask)
        if mask.dtype.kind in "iu" and mask.dtype.itemsize == 8:
            mask = mask.astype(np.float32)
    return jnp.asarray(mask)


def _resolve_opset(opset) -> int:
    opset = _check_int_attr("opset", opset)
    if opset < MIN_OPSET:
        raise _error(f"ai.onnx Attention exists from opset {MIN_OPSET}, got opset={opset}")
    return opset


def _heads_back(y, is_3d: bool):
    """[B, H, S, Dv] -> [B, S, H * Dv] for 3D callers."""
    if not is_3d:
        return y
    b, h, s, dv = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, s, h * dv)


#: Keyword arguments both public forms take and `_prepare` validates.
_ATTRIBUTES = ("is_causal", "scale", "softcap", "qk_matmul_output_mode", "softmax_precision",
               "left_window_size", "right_window_size")


def _prepare(Q, K, V, arguments: dict):
    """Validation shared by both forms, from the caller's arguments (its `locals()` on entry):
    (q, k, v in BHSD, is_3d, opset, static attributes for the reference function)."""
    opset = _resolve_opset(arguments["opset"])
    check_backend(arguments["backend"])
    Q, K, V = jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V)
    attrs = _check_attributes(**{name: arguments[name] for name in _ATTRIBUTES}, opset=opset)
    q, k, v, is_3d = _to_bhsd(Q, K, V, arguments["q_num_heads"], arguments["kv_num_heads"],
                              heads_allowed_4d=opset < 25)
    _check_qkv(q, k, v)
    if attrs["scale"] is None:
        attrs["scale"] = 1.0 / math.sqrt(q.shape[3])
    return q, k, v, is_3d, opset, attrs


# ---------------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------------

def attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *,
              is_causal: int = 0, scale: float | None = None, softcap: float = 0.0,
              q_num_heads: int | None = None, kv_num_heads: int | None = None,
              qk_matmul_output_mode: int = 0, softmax_precision=None, left_window_size: int = -1,
              right_window_size: int = -1, opset: int = 24, return_qk: bool = False,
              backend: str = "auto") -> AttentionOutputs:
    """ai.onnx Attention, opsets 23-25 (onnx 1.23.2 semantics, errata included).

    Inputs (ONNX names; B batch, S query length, L new key length, P past length, T = P + L):
      Q: [B, Hq, S, D] or 3D [B, S, Hq * D]; float16 / bfloat16 / float32 / float64 (T1).
      K: [B, Hkv, L, D] or 3D [B, L, Hkv * D]; T1. 3D vs 4D is decided by rank.
      V: [B, Hkv, L, Dv] or 3D [B, L, Hkv * Dv]; any float type (T2); Dv may differ from D.
      attn_mask: rank 1-4, broadcast right-aligned to [B, Hq, S, T] (rank 3 = [Hq, S, T]). Bool:
        True attends; int / float: added to the logits. From opset 24 the last dim may be shorter
        than T and is padded with -inf (a last dim of 1 too: padded, not broadcast, as in onnx's
        reference; onnxruntime requires T).
      past_key, past_value: [B, Hkv, P, D] of T1 and [B, Hkv, P, Dv] of T2; both or neither.
      nonpad_kv_seqlen: integer [B], opset >= 24, not with past: keys j >= nonpad[b] are padding.

    Attributes (static):
      is_causal: 0/1. Query i attends key j iff j <= i + offset, offset = P with past,
        nonpad[b] - S with nonpad, else 0 (top-left when S < L without a cache).
      scale: multiplies Q @ K^T; default 1 / sqrt(D).
      softcap: softcap * tanh(x / softcap) on the scaled logits, before any mask; 0 = off.
      q_num_heads, kv_num_heads: head counts of 3D inputs (required there; must match 4D inputs, and
        must be absent for 4D inputs from opset 25).
      qk_matmul_output_mode: what `qk` holds: 0 scale * Q @ K^T (before softcap), 1 after softcap,
        2 after softcap and every bias (-inf where masked), 3 softmax probabilities (0 rows where
        fully masked).
      softmax_precision: TensorProto enum 1 / 10 / 11 / 16 (or a dtype): the softmax runs on the
        biased logits cast to it. Default: float32 for half inputs (float64 for float64).
      left_window_size, right_window_size: opset 25 sliding window, -1 = unbounded: query at
        position p = i + offset attends keys p - left <= j <= p + right.
      opset: the ai.onnx opset of the model (>= 23); nonpad needs >= 24, windows >= 25.
      return_qk: also return the qk_matmul_output tensor.
      backend: "auto", "reference" or "cuda" (our kernels take steps of up to
        `decode_paths.MAX_QUERY_ROWS` query rows in float32 / float16 / bfloat16, and longer
        prompts the prefill engine computes exactly on sm_90:
        `decode_paths.attention_prefill_route`).

    Fully masked query rows give 0 in y and in mode-3 qk (never NaN). Products accumulate in f32 for
    half types. Invalid inputs raise ValueError / TypeError at trace time.

    Returns:
      AttentionOutputs(y, present_key, present_value, qk).
    """
    q, k, v, is_3d, opset, attrs = _prepare(Q, K, V, locals())
    b, hq, s, _ = q.shape

    if (past_key is None) != (past_value is None):
        given, missing = ("past_key", "past_value") if past_value is None else \
            ("past_value", "past_key")
        raise _error(f"{given} is given without {missing}")
    past = 0
    if past_key is not None:
        past_key, past_value = jnp.asarray(past_key), jnp.asarray(past_value)
        _check_pair("past_key", past_key, k, "P")
        _check_pair("past_value", past_value, v, "P")
        if past_key.shape[2] != past_value.shape[2]:
            raise _error(f"past_key has {past_key.shape[2]} rows but past_value has "
                         f"{past_value.shape[2]}")
        past = past_key.shape[2]
    if nonpad_kv_seqlen is not None:
        if opset < 24:
            raise _error(f"nonpad_kv_seqlen needs opset >= 24, got opset={opset}")
        if past_key is not None:
            raise _error("nonpad_kv_seqlen cannot be combined with past_key / past_value (it "
                         "describes an external cache held in K and V)")
        nonpad_kv_seqlen = _check_lengths("nonpad_kv_seqlen", nonpad_kv_seqlen, b)
    total = past + k.shape[2]
    if total == 0:
        raise _error(f"K has no keys and there is no past (T = P + L = 0): there is nothing to "
                     f"attend to (K shape {_shape(K)})")
    if attn_mask is not None:
        attn_mask = _normalise_mask(_mask_array(attn_mask), (b, hq, s, total), short_ok=opset >= 24,
                                    total_name="total_sequence_length T",
                                    short_rule="a shorter mask needs opset >= 24")

    fn = functools.partial(reference.attention, return_qk=bool(return_qk), **attrs)
    hkv = k.shape[1]
    cuda_fn, why = decode_paths.attention_cuda(
        attrs, return_qk=bool(return_qk), q=q,
        present_key=jax.ShapeDtypeStruct((b, hkv, total, k.shape[3]), k.dtype),
        present_value=jax.ShapeDtypeStruct((b, hkv, total, v.shape[3]), v.dtype),
        cache="past" if past_key is not None else "none" if nonpad_kv_seqlen is None else "nonpad",
        new_rows=k.shape[2], has_mask=attn_mask is not None)
    y, present_key, present_value, qk = dispatch(
        _OP, backend, fn, cuda_fn, q, k, v, attn_mask, past_key, past_value, nonpad_kv_seqlen,
        unsupported=why, rule=partitioning.ATTENTION)
    return AttentionOutputs(_heads_back(y, is_3d), present_key, present_value, qk)


def attention_with_cache(Q, K, V, key_cache, value_cache, cache_lengths, attn_mask=None, *,
                         is_causal: int = 0, scale: float | None = None, softcap: float = 0.0,
                         q_num_heads: int | None = None, kv_num_heads: int | None = None,
                         qk_matmul_output_mode: int = 0, softmax_precision=None,
                         left_window_size: int = -1, right_window_size: int = -1,
                         opset: int = 24, return_qk: bool = False,
                         backend: str = "auto") -> CachedAttentionOutputs:
    """Attention over a fixed-capacity KV cache: the decoding form of `attention` with past.

    Equals `attention(Q, K, V, mask, past_key=key_cache[b, :, :len_b], past_value=...)` per batch row
    b with len_b = cache_lengths[b], without any shape depending on the lengths.

    Args:
      Q, K, V: as in `attention` (3D with q_num_heads / kv_num_heads, or 4D); K and V hold the S new
        rows (S = Q's sequence length = K's).
      key_cache: [B, Hkv, C, D] of K's dtype; C is the capacity.
      value_cache: [B, Hkv, C, Dv] of V's dtype.
      cache_lengths: integer [B] on the device: valid rows per batch before this step. The new rows
        go to rows len_b .. len_b + S - 1 (via `ops.kv_append`); keys j >= len_b + S are masked.
      attn_mask: as in `attention`, against [B, Hq, S, C] (cache positions); a last dim shorter than
        C is padded with -inf.
      is_causal, scale, softcap, qk_matmul_output_mode, softmax_precision, left_window_size,
        right_window_size, q_num_heads, kv_num_heads, opset, return_qk, backend: as in
        `attention` (the causal / window offset of batch b is len_b; windows need opset >= 25).

    Donate key_cache / value_cache to the jit for an in-place update. Lengths never cause a
    host read.

    Returns:
      CachedAttentionOutputs(y, key_cache, value_cache, cache_lengths, status, qk).
    """
    q, k, v, is_3d, _, attrs = _prepare(Q, K, V, locals())
    b, hq, s, _ = q.shape
    if k.shape[2] != s:
        raise _error(f"attention_with_cache needs K / V with the query's {s} new rows, got "
                     f"{k.shape[2]}")
    key_cache, value_cache = jnp.asarray(key_cache), jnp.asarray(value_cache)
    _check_pair("key_cache", key_cache, k, "C")
    _check_pair("value_cache", value_cache, v, "C")
    capacity = key_cache.shape[2]
    if value_cache.shape[2] != capacity:
        raise _error(f"key_cache capacity {capacity} differs from value_cache capacity "
                     f"{value_cache.shape[2]}")
    if s > capacity:
        raise _error(f"{s} new rows do not fit a cache of capacity {capacity}")
    cache_lengths = _check_lengths("cache_lengths", cache_lengths, b)
    if attn_mask is not None:
        attn_mask = _normalise_mask(_mask_array(attn_mask), (b, hq, s, capacity), short_ok=True,
                                    total_name="cache capacity C", short_rule="")

    key_cache, status_k = kv_append(key_cache, k, cache_lengths, backend=backend)
    value_cache, status_v = kv_append(value_cache, v, cache_lengths, backend=backend)
    status = status_k | status_v
    written = status == st.OK
    # ONNX's external-cache form: valid keys = nonpad, causal / window offset = nonpad - S = len.
    # A row whose write was skipped gets nonpad 0: fully masked, so y is 0 rather than stale data.
    valid = jnp.where(written, cache_lengths + s, 0)
    fn = functools.partial(reference.attention, return_qk=bool(return_qk), **attrs)
    cuda_fn, why = decode_paths.attention_cuda(attrs, return_qk=bool(return_qk), q=q,
                                               present_key=key_cache, present_value=value_cache,
                                               cache="nonpad", new_rows=s,
                                               has_mask=attn_mask is not None)
    y, _, _, qk = dispatch(_OP, backend, fn, cuda_fn, q, key_cache, value_cache, attn_mask, None, None,
                           valid, unsupported=why, rule=partitioning.ATTENTION)
    new_lengths = jnp.where(written, cache_lengths + s, cache_lengths)
    return CachedAttentionOutputs(_heads_back(y, is_3d), key_cache, value_cache, new_lengths, status,
                                  qk)
