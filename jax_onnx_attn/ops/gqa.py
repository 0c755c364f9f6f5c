"""com.microsoft::GroupQueryAttention as a JAX op: trace-time validation, static shapes, dispatch."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.ops import decode_paths, partitioning
from jax_onnx_attn.ops import status as st
from jax_onnx_attn.ops.backend import dispatch
from jax_onnx_attn.ops.dtypes import FLOAT_DTYPES, host_integers_fit, lengths_int32
from jax_onnx_attn.ops.reference import gqa as reference
from jax_onnx_attn.ops.reference import quant

OP = "group_query_attention"
QUANT_TYPES = ("NONE", "PER_TENSOR", "PER_CHANNEL")


class GroupQueryAttentionOutput(NamedTuple):
    """The op's results.

    output:        [B, S, N·D], the query's dtype.
    present_key:   [B, Hkv, P', D] (uint8 [.., D/2] for int4), the cache dtype; P' is the past
                   capacity P for a shared buffer or a sliding-window cache, else
                   max(total_sequence_length, P).
    present_value: like present_key.
    output_qk:     [B, N, S, total_sequence_length] when qk_output is 1 or 2, else None.
    status:        int32 [B], 0 or flags of `jax_onnx_attn.ops.status` (a refused cache write).
    """
    output: jax.Array
    present_key: jax.Array
    present_value: jax.Array
    output_qk: jax.Array | None
    status: jax.Array


class QkvProjection(NamedTuple):
    """A packed query given also as the projection that makes it (`onnx.fusion`'s pass 5):
    query = from_rotary_pair_order(rms_norm(x) W^T (+ bias)). The CUDA decode route of one row
    computes the projection and the step preparation in one launch
    (`cuda_matmul.linear_gqa_prepare`); every other route reads `query`.

    x:            [B, S, K] of the query's dtype (before the norm when norm_weight is given).
    w:            the weight with its rows in `ops.linear.rotary_pair_order(N, Hkv, D, rotary_half)`:
                  [N·, K] of x's dtype (bits 16) or 4-bit in the record layout (bits 4).
    bias:         [N·] in the same order, or None.
    norm_weight:  [K] (RMS-norm prologue with norm_epsilon), or None.
    """
    x: jax.Array
    w: jax.Array
    bias: jax.Array | None
    norm_weight: jax.Array | None
    norm_epsilon: float
    bits: int
    block_size: int
    rotary_half: int


def _fail(name: str, rule: str, exc=ValueError):
    raise exc(f"{OP}: {name}: {rule}")


def _array(name, x):
    if x is None:
        return None
    if isinstance(x, (int, float, bool)) or not hasattr(x, "dtype"):
        x = np.asarray(x)
    # 64-bit host integers are saturated, not wrapped, on their way to 32 bits.
    x = host_integers_fit(x)
    return jnp.asarray(x) if not isinstance(x, jax.Array) else x


def _static_int(name, value):
    """A value that decides output shapes: an int from a Python int or a concrete array, or the
    traced int32 scalar when only the device knows it (the caller derives the shapes then)."""
    if value is None:
        _fail(name, "is required")
    shape = np.shape(value)
    if int(np.prod(shape, dtype=np.int64)) != 1:
        _fail(name, f"must be a scalar or a 1-element tensor, got shape {tuple(shape)}")
    dtype = np.dtype(value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype)
    if not np.issubdtype(dtype, np.integer):
        _fail(name, f"must be an integer, got {dtype}", TypeError)
    try:
        arr = np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return lengths_int32(jnp.reshape(value, ()))
    return int(arr.reshape(()))


def _check_same_dtype(name, x, dtype):
    if x is not None and x.dtype != dtype:
        _fail(name, f"must have the query's dtype {dtype}, got {x.dtype}", TypeError)


def _check_shape(name, x, shape):
    if x is not None and tuple(x.shape) != tuple(shape):
        _fail(name, f"must have shape {list(shape)}, got {list(x.shape)}")


def _check_int(name, x, shape):
    if x is None:
        return None
    if not jnp.issubdtype(x.dtype, jnp.integer):
        _fail(name, f"must be an integer tensor, got {x.dtype}", TypeError)
    _check_shape(name, x, shape)
    return lengths_int32(x)


def _check_scale(name, x, mode, hkv, d):
    """k_scale / v_scale -> float32 broadcastable to a [B, Hkv, L, D] cache."""
    if x is None:
        _fail(name, f"is required when the cache is quantised ({mode})")
    if x.dtype != jnp.float32:
        _fail(name, f"must be float32, got {x.dtype}", TypeError)
    if mode == "PER_TENSOR":
        if x.size != 1:
            _fail(name, f"PER_TENSOR takes one element, got shape {list(x.shape)}")
        return x.reshape(())
    if x.size != hkv * d:
        _fail(name, f"PER_CHANNEL takes kv_num_heads*head_size = {hkv * d} elements "
                    f"([1, {hkv}, 1, {d}]), got shape {list(x.shape)}")
    return x.reshape(1, hkv, 1, d)


def _derived_total(attention_bias, past_key, shared_buffer: bool, kv_len: int, s: int) -> int:
    """The width total_sequence_length sets when only the device knows its value: attention_bias's
    last dim when given, else P (shared buffer), P + new rows (growing cache) or S (no past)."""
    if attention_bias is not None and np.ndim(attention_bias) == 4:
        return int(attention_bias.shape[3])
    if past_key is None:
        return s
    return int(past_key.shape[2]) + (0 if shared_buffer else kv_len)


def _total_ok(total, seqlens_k, *, static_total: int, s: int, kv_len: int, past_len: int,
              has_past: bool, shared: bool, windowed: bool, cos_rows: int | None, bias_given: bool,
              qk: bool):
    """Device check of a traced total_sequence_length against onnxruntime's rules (bool [B]):
    S on a first prompt, P + S (growing) or <= P (static) with a past, every row's seqlens_k below
    onnxruntime's present length max(total, P), within the rotary table and the bias width."""
    ok = total >= max(s, 1) if not windowed else total >= 1
    ok = jnp.broadcast_to(ok, seqlens_k.shape)
    if not has_past:
        ok = ok & (total == s)
    elif not windowed:
        ok = ok & ((total == s) | (total == past_len + kv_len) | (total <= past_len))
        if not shared:
            ok = ok & (total <= static_total)  # the derived present holds every row
    if cos_rows is not None:
        ok = ok & (total <= cos_rows)
    if bias_given or qk:
        ok = ok & (total == static_total)  # the bias / output_qk width is total
    return ok


def _rows_fit(total, seqlens_k, *, past_len: int, has_past: bool, shared: bool, windowed: bool):
    """bool [B]: onnxruntime's seqlens_k[b] < present length max(total, P) (a non-shared present;
    the derived present may be longer, so the device checks the rule itself)."""
    if not has_past or shared or windowed:
        return jnp.ones(seqlens_k.shape, bool)
    return seqlens_k < jnp.maximum(total, past_len)



class _Attributes(NamedTuple):
    """The op's attributes, checked and resolved (the config's static part before shapes)."""
    n: int
    hkv: int
    window: int
    quantized: bool
    bits: int
    eps: dict


def _check_attributes(num_heads, kv_num_heads, causal, do_rotary, rotary_interleaved,
                      sliding_window_cache, qk_output, local_window_size, k_quant_type, v_quant_type,
                      kv_cache_bit_width, qk_norm_epsilon, q_norm_epsilon, k_norm_epsilon
                      ) -> _Attributes:
    for name, val in (("num_heads", num_heads), ("kv_num_heads", kv_num_heads)):
        if not isinstance(val, (int, np.integer)) or val <= 0:
            _fail(name, f"must be a positive int, got {val!r}")
    n, hkv = int(num_heads), int(kv_num_heads)
    if n % hkv:
        _fail("num_heads", f"must be a multiple of kv_num_heads ({n} % {hkv} = {n % hkv})")
    for name, val in (("causal", causal), ("do_rotary", do_rotary),
                      ("rotary_interleaved", rotary_interleaved),
                      ("sliding_window_cache", sliding_window_cache)):
        if int(val) not in (0, 1):
            _fail(name, f"must be 0 or 1, got {val!r}")
    if int(qk_output) not in (0, 1, 2):
        _fail("qk_output", f"must be 0, 1 (logits) or 2 (probabilities), got {qk_output!r}")
    window = int(local_window_size)
    if window < -1:
        _fail("local_window_size", f"must be -1 (off) or >= 0, got {window}")
    if not causal and window != -1:
        _fail("local_window_size", "must be -1 when causal is 0")
    if k_quant_type not in QUANT_TYPES:
        _fail("k_quant_type", f"must be one of {QUANT_TYPES}, got {k_quant_type!r}")
    if v_quant_type not in QUANT_TYPES:
        _fail("v_quant_type", f"must be one of {QUANT_TYPES}, got {v_quant_type!r}")
    if k_quant_type != v_quant_type:
        _fail("v_quant_type", f"must equal k_quant_type ({k_quant_type!r}), got {v_quant_type!r}")
    quantized = k_quant_type != "NONE"
    bits = int(kv_cache_bit_width)
    if quantized and bits not in (4, 8):
        _fail("kv_cache_bit_width", f"must be 4 or 8 for a quantised cache, got {bits}")
    eps = {}
    for name, val in (("qk_norm_epsilon", qk_norm_epsilon), ("q_norm_epsilon", q_norm_epsilon),
                      ("k_norm_epsilon", k_norm_epsilon)):
        if val is not None and not (math.isfinite(val) and val > 0):
            _fail(name, f"must be finite and positive, got {val!r}")
        eps[name] = val
    return _Attributes(n, hkv, window, quantized, bits, eps)


def _check_qkv(query, key, value, a: _Attributes):
    """query / key / value -> (query, key, value, dtype, b, s, d, kv_len); kv_len is the new K/V
    rows (0 for a KV-shared layer)."""
    n, hkv = a.n, a.hkv
    query, key, value = _array("query", query), _array("key", key), _array("value", value)
    if query is None:
        _fail("query", "is required")
    if query.ndim != 3:
        _fail("query", f"must be 3-D [B, S, hidden], got shape {list(query.shape)}")
    if query.dtype not in FLOAT_DTYPES:
        _fail("query", f"must be one of {[str(t) for t in FLOAT_DTYPES]}, got {query.dtype}",
              TypeError)
    dtype = query.dtype
    b, s, hidden = query.shape
    if (key is None) != (value is None):
        _fail("key" if key is None else "value", "key and value must be both given or both absent "
                                                 "(absent: packed QKV in query)")
    packed = key is None
    heads_in_query = n + 2 * hkv if packed else n
    if hidden % heads_in_query:
        what = "(num_heads + 2*kv_num_heads)" if packed else "num_heads"
        _fail("query", f"hidden size {hidden} is not a multiple of {what} = {heads_in_query}")
    d = hidden // heads_in_query
    if s == 0:
        _fail("query", f"sequence length must be >= 1 (a step has a query token), got shape "
                       f"{list(query.shape)}")
    if d == 0:
        _fail("query", f"head_size must be >= 8, got 0 (hidden size {hidden})")
    if d % 8:
        _fail("query", f"head_size must be a multiple of 8, got {d}")
    kv_len = s
    if not packed:
        for name, x in (("key", key), ("value", value)):
            if x.ndim != 3:
                _fail(name, f"must be 3-D [B, S, kv_num_heads*head_size], got {list(x.shape)}")
            _check_same_dtype(name, x, dtype)
            if x.shape[0] != b:
                _fail(name, f"batch size {x.shape[0]} differs from the query's {b}")
            if x.shape[1] not in (s, 0):
                _fail(name, f"sequence length must be the query's ({s}) or 0 (KV-shared layer), "
                            f"got {x.shape[1]}")
            if x.shape[2] != hkv * d:
                _fail(name, f"hidden size must be kv_num_heads*head_size = {hkv * d}, got {x.shape[2]}")
        if key.shape[1] != value.shape[1]:
            _fail("value", f"sequence length {value.shape[1]} differs from the key's {key.shape[1]}")
        kv_len = key.shape[1]
    return query, key, value, dtype, b, s, d, kv_len


def _check_past(past_key, past_value, a: _Attributes, dtype, b, d, kv_len, shared_buffer,
                past_empty, sliding_window_cache):
    """past_key / past_value -> (past_key, past_value, past_len)."""
    hkv, quantized, bits = a.hkv, a.quantized, a.bits
    past_key, past_value = _array("past_key", past_key), _array("past_value", past_value)
    if (past_key is None) != (past_value is None):
        _fail("past_key" if past_key is None else "past_value",
              "past_key and past_value must be both given or both absent")
    cache_d = d // 2 if quantized and bits == 4 else d
    if quantized:
        cache_dtype = quant.storage_dtype(bits)
    else:
        cache_dtype = dtype
    past_len = 0
    if past_key is not None:
        for name, x in (("past_key", past_key), ("past_value", past_value)):
            if x.ndim != 4:
                _fail(name, f"must be 4-D [B, kv_num_heads, P, head_size], got {list(x.shape)}")
            if (x.shape[0], x.shape[1], x.shape[3]) != (b, hkv, cache_d):
                _fail(name, f"must be [{b}, {hkv}, P, {cache_d}], got {list(x.shape)}")
            if x.dtype != cache_dtype:
                what = (f"{bits}-bit quantised cache" if quantized else "the query's dtype")
                _fail(name, f"must be {cache_dtype} ({what}), got {x.dtype}", TypeError)
        if past_key.shape[2] != past_value.shape[2]:
            _fail("past_value", f"length {past_value.shape[2]} differs from past_key's {past_key.shape[2]}")
        past_len = past_key.shape[2]
    elif quantized:
        _fail("past_key", "is required for a quantised cache (it sets the cache's type)")
    if shared_buffer and past_key is None:
        _fail("past_key", "is required with shared_buffer=True (it is the buffer)")
    if past_empty and (past_key is None or not shared_buffer or sliding_window_cache):
        _fail("past_empty", "needs a shared fixed-capacity cache (past_key with shared_buffer=True, "
                            "sliding_window_cache=0)")
    if kv_len == 0 and past_key is None:
        _fail("past_key", "is required when key/value have no rows (KV-shared layer)")
    return past_key, past_value, past_len


def _check_lengths(seqlens_k, total_sequence_length, query_seqlens, a: _Attributes, causal,
                   sliding_window_cache, shared_buffer, past_key, past_len, b, s, kv_len,
                   attention_bias):
    """-> (seqlens_k, query_seqlens, total, first_prompt, windowed, present_len)."""
    window = a.window
    seqlens_k = _array("seqlens_k", seqlens_k)
    if seqlens_k is None:
        _fail("seqlens_k", "is required")
    seqlens_k = _check_int("seqlens_k", seqlens_k, (b,))
    total = _static_int("total_sequence_length", total_sequence_length)
    query_seqlens = _check_int("query_seqlens", _array("query_seqlens", query_seqlens), (b,))
    windowed = bool(sliding_window_cache)
    total_device = None
    if not isinstance(total, int):
        # Only the device knows the value (a traced input of a user's jit): the shapes it would set
        # are derived from the other inputs and the value is checked on the device (status).
        total_device = total
        total = _derived_total(attention_bias, past_key, shared_buffer, kv_len, s)
    if total < 1:
        _fail("total_sequence_length", f"must be >= 1, got {total}")
    if not windowed and total < s:
        _fail("total_sequence_length", f"must be >= the query length {s}, got {total}")
    if query_seqlens is not None:
        if not causal:
            _fail("query_seqlens", "requires causal=1")
        if past_key is None:
            _fail("query_seqlens", "requires past_key and past_value")
        if kv_len != s:
            _fail("query_seqlens", "requires key/value with the query's sequence length")
        first_prompt = False
    elif total_device is not None:
        # Without a past every step is a first prompt; with one, the device tells (total == S).
        first_prompt = True if past_key is None else None
    else:
        first_prompt = s == total
        if not first_prompt and s > 1 and past_key is None:
            _fail("past_key", f"is required for a multi-token step that is not a first prompt "
                              f"(S={s} != total_sequence_length={total})")
    if windowed:
        if window <= 0:
            _fail("local_window_size", "must be > 0 with sliding_window_cache=1")
        if past_key is None:
            _fail("past_key", "is required with sliding_window_cache=1 (its length is the capacity)")
        if past_len < window:
            _fail("past_key", f"capacity {past_len} must be >= local_window_size {window} with "
                              f"sliding_window_cache=1")
        present_len = past_len
    elif total_device is not None:
        present_len = past_len if shared_buffer else max(total, past_len)
    else:
        present_len = past_len if shared_buffer else max(total, past_len)
        # onnxruntime's rule: a growing cache (total = P + S) or a static one (total <= P).
        if past_key is not None and total != past_len + kv_len and total > past_len:
            _fail("total_sequence_length", f"must be P + S = {past_len + kv_len} (growing cache) "
                                           f"or <= P = {past_len} (static cache), got {total}")
        if past_key is None and not first_prompt:
            _fail("past_key", f"is required when S={s} != total_sequence_length={total}")
    return seqlens_k, query_seqlens, total, total_device, first_prompt, windowed, present_len


def _check_rotary(cos_cache, sin_cache, position_ids, do_rotary, dtype, d, total, b, s,
                  total_known: bool = True):
    """-> (cos_cache, sin_cache, position_ids), all None without rotary."""
    cos_cache, sin_cache = _array("cos_cache", cos_cache), _array("sin_cache", sin_cache)
    if (cos_cache is None) != (sin_cache is None):
        _fail("cos_cache" if cos_cache is None else "sin_cache",
              "cos_cache and sin_cache must be both given or both absent")
    if do_rotary and cos_cache is None:
        _fail("cos_cache", "is required when do_rotary=1")
    if cos_cache is not None:
        for name, x in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
            _check_same_dtype(name, x, dtype)
            if x.ndim != 2:
                _fail(name, f"must be 2-D [max_position, rotary_dim/2], got {list(x.shape)}")
            if d % 16:
                _fail(name, f"rotary needs head_size to be a multiple of 16, got {d}")
            if x.shape[0] < total and total_known:
                _fail(name, f"dimension 0 ({x.shape[0]}) must be >= total_sequence_length {total}: "
                            f"the rotary table covers {x.shape[0]} positions, so the model "
                            f"supports sequences of at most {x.shape[0]} tokens")
            if x.shape[1] > d // 2 or x.shape[1] % 8:
                _fail(name, f"dimension 1 ({x.shape[1]}) must be <= head_size/2 = {d // 2} and a "
                            f"multiple of 8")
        if cos_cache.shape != sin_cache.shape:
            _fail("sin_cache", f"shape {list(sin_cache.shape)} differs from cos_cache's "
                               f"{list(cos_cache.shape)}")
    position_ids = _check_int("position_ids", _array("position_ids", position_ids), (b, s))
    if not do_rotary:
        # cos/sin and position_ids only feed the rotary embedding.
        cos_cache = sin_cache = position_ids = None
    return cos_cache, sin_cache, position_ids


def _check_extras(attention_bias, head_sink, k_scale, v_scale, q_norm_weight, k_norm_weight,
                  a: _Attributes, k_quant_type, v_quant_type, dtype, b, s, d, total):
    """-> (attention_bias, head_sink, k_scale, v_scale, q_norm_weight, k_norm_weight)."""
    n, hkv, quantized = a.n, a.hkv, a.quantized
    attention_bias = _array("attention_bias", attention_bias)
    if attention_bias is not None:
        _check_same_dtype("attention_bias", attention_bias, dtype)
        shp = attention_bias.shape
        if (attention_bias.ndim != 4 or shp[0] not in (1, b) or shp[1] not in (1, n)
                or shp[2] != s or shp[3] != total):
            _fail("attention_bias", f"must be [{b} or 1, {n} or 1, {s}, {total}] "
                                    f"(B|1, N|1, S, total_sequence_length), got {list(shp)}")
    head_sink = _array("head_sink", head_sink)
    _check_same_dtype("head_sink", head_sink, dtype)
    _check_shape("head_sink", head_sink, (n,))
    k_scale, v_scale = _array("k_scale", k_scale), _array("v_scale", v_scale)
    if quantized:
        k_scale = _check_scale("k_scale", k_scale, k_quant_type, hkv, d)
        v_scale = _check_scale("v_scale", v_scale, v_quant_type, hkv, d)
    else:
        k_scale = v_scale = None
    q_norm_weight = _array("q_norm_weight", q_norm_weight)
    k_norm_weight = _array("k_norm_weight", k_norm_weight)
    if (q_norm_weight is None) != (k_norm_weight is None):
        _fail("q_norm_weight" if q_norm_weight is None else "k_norm_weight",
              "q_norm_weight and k_norm_weight must be both given or both absent")
    for name, x in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        _check_same_dtype(name, x, dtype)
        _check_shape(name, x, (d,))
    return attention_bias, head_sink, k_scale, v_scale, q_norm_weight, k_norm_weight


def _prepare(arguments: dict):
    """Every check of the op, once (the CUDA paths and handlers do not repeat them): the inputs
    normalised and the static GQAConfig that the reference and the CUDA routes take.

    Returns (config, args, device): args in the reference's order (query .. query_seqlens);
    device is None, or (for a traced total_sequence_length) what the device check needs.
    """
    g = arguments
    a = _check_attributes(g["num_heads"], g["kv_num_heads"], g["causal"], g["do_rotary"],
                          g["rotary_interleaved"], g["sliding_window_cache"], g["qk_output"],
                          g["local_window_size"], g["k_quant_type"], g["v_quant_type"],
                          g["kv_cache_bit_width"], g["qk_norm_epsilon"], g["q_norm_epsilon"],
                          g["k_norm_epsilon"])
    query, key, value, dtype, b, s, d, kv_len = _check_qkv(g["query"], g["key"], g["value"], a)
    past_key, past_value, past_len = _check_past(
        g["past_key"], g["past_value"], a, dtype, b, d, kv_len, g["shared_buffer"], g["past_empty"],
        g["sliding_window_cache"])
    seqlens_k, query_seqlens, total, total_device, first_prompt, windowed, present_len = \
        _check_lengths(g["seqlens_k"], g["total_sequence_length"], g["query_seqlens"], a,
                       g["causal"], g["sliding_window_cache"], g["shared_buffer"], past_key,
                       past_len, b, s, kv_len, _array("attention_bias", g["attention_bias"]))
    cos_cache, sin_cache, position_ids = _check_rotary(
        g["cos_cache"], g["sin_cache"], g["position_ids"], g["do_rotary"], dtype, d, total, b, s,
        total_known=total_device is None)
    attention_bias, head_sink, k_scale, v_scale, q_norm_weight, k_norm_weight = _check_extras(
        g["attention_bias"], g["head_sink"], g["k_scale"], g["v_scale"], g["q_norm_weight"],
        g["k_norm_weight"], a, g["k_quant_type"], g["v_quant_type"], dtype, b, s, d, total)
    scale, softcap, eps = g["scale"], g["softcap"], a.eps
    config = reference.GQAConfig(
        num_heads=a.n, kv_num_heads=a.hkv, head_size=d, total_sequence_length=total,
        present_length=present_len, scale=float(scale) if scale else 1.0 / math.sqrt(d),
        softcap=float(softcap) if softcap > 0 else 0.0, local_window_size=a.window,
        do_rotary=bool(g["do_rotary"]), rotary_interleaved=bool(g["rotary_interleaved"]),
        smooth_softmax=int(g["smooth_softmax"]) == 1, qk_output=int(g["qk_output"]),
        causal=bool(g["causal"]), sliding_window_cache=windowed,
        kv_bits=a.bits if a.quantized else 0,
        q_norm_epsilon=float(eps["q_norm_epsilon"] or g["qk_norm_epsilon"]),
        k_norm_epsilon=float(eps["k_norm_epsilon"] or g["qk_norm_epsilon"]),
        shared_buffer=bool(g["shared_buffer"]), first_prompt=first_prompt,
        past_empty=bool(g["past_empty"]))
    args = (query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache, position_ids,
            attention_bias, head_sink, k_scale, v_scale, q_norm_weight, k_norm_weight, query_seqlens)
    device = None
    if total_device is not None:
        device = dict(total=total_device, static_total=total, s=s, kv_len=kv_len,
                      past_len=past_len, has_past=past_key is not None,
                      shared=bool(g["shared_buffer"]), windowed=windowed,
                      cos_rows=None if cos_cache is None else cos_cache.shape[0],
                      bias_given=attention_bias is not None, qk=bool(int(g["qk_output"])))
    return config, args, device


def group_query_attention(query, key=None, value=None, past_key=None, past_value=None,
                          seqlens_k=None, total_sequence_length=None, cos_cache=None,
                          sin_cache=None, position_ids=None, attention_bias=None, head_sink=None,
                          k_scale=None, v_scale=None, q_norm_weight=None, k_norm_weight=None,
                          query_seqlens=None, *, num_heads: int, kv_num_heads: int,
                          scale: float = 0.0, softcap: float = 0.0, local_window_size: int = -1,
                          do_rotary: int = 0, rotary_interleaved: int = 0, smooth_softmax: int = -1,
                          qk_output: int = 0, causal: int = 1, sliding_window_cache: int = 0,
                          k_quant_type: str = "NONE", v_quant_type: str = "NONE",
                          kv_cache_bit_width: int = 0, qk_norm_epsilon: float = 1e-6,
                          q_norm_epsilon: float | None = None, k_norm_epsilon: float | None = None,
                          shared_buffer: bool = False, past_empty: bool = False,
                          query_projection: QkvProjection | None = None,
                          backend: str = "auto") -> GroupQueryAttentionOutput:
    """com.microsoft::GroupQueryAttention (onnxruntime contrib op), inputs and attributes by their
    ONNX names. Semantics are onnxruntime's CPU kernel, plus what it lacks (bf16, q/k norm, any
    batch size for multi-token steps with a past, output_qk with a sliding-window cache).

    B batch, S query length, N = num_heads, Hkv = kv_num_heads, D head size, P past capacity,
    T_b = seqlens_k[b] + 1 (tokens in the cache after this step), total = total_sequence_length.

    Inputs (dtype T = float32 / float16 / bfloat16, float64 on the reference backend):
      query: [B, S, N·D] T, or packed [B, S, (N + 2·Hkv)·D] (Q | K | V) when key/value are None.
      key, value: [B, S, Hkv·D] T; or [B, 0, Hkv·D] for a KV-shared layer (nothing appended,
        the query attends to the T_b cached rows, the last query at position T_b - 1).
      past_key, past_value: [B, Hkv, P, D] T, int8 (8-bit) or uint8 [B, Hkv, P, D/2] (4-bit).
      seqlens_k: integer [B], T_b - 1; read on the device, drives every mask and write.
      total_sequence_length: Python int or concrete integer scalar / 1-element array (static):
        S == total marks a first prompt; it sets present's length (non-shared) and output_qk's
        width. A traced value (only the device knows it, e.g. a graph input under a user's jit)
        is allowed: the widths are derived from attention_bias, the past (P, or P + S growing)
        or S, the step type is decided on the device, and a value breaking onnxruntime's rules
        sets status TOTAL_SEQUENCE_LENGTH_INVALID (the reference backend runs such a call).
      cos_cache, sin_cache: [max_position >= total, R/2] T, R/2 a multiple of 8, R <= D
        (partial rotary), D % 16 == 0; used when do_rotary=1.
      position_ids: integer [B, S]; rotary positions. On a first prompt only position_ids[0, 0]
        is read (onnxruntime's behaviour): positions are s + position_ids[0, 0] for every row.
        Without it positions are past_b + s. A position beyond the cos/sin table reads its
        last row (only the device sees the values; onnxruntime rejects them on the host).
      attention_bias: [B|1, N|1, S, total] T, added after softcap, indexed by absolute key position.
      head_sink: [N] T, a per-head extra softmax logit (attention sink), in any dtype.
      k_scale, v_scale: float32, 1 element (PER_TENSOR) or Hkv·D ([1, Hkv, 1, D], PER_CHANNEL).
      q_norm_weight, k_norm_weight: [D] T, per-head RMSNorm of Q and K before rotary.
      query_seqlens: integer [B], valid (right-padded) rows of a multi-token chunk (onnxruntime
        1.32); the chunk's tokens start at past_b = T_b - query_seqlens[b].

    Attributes (keyword-only): num_heads, kv_num_heads; scale (0 -> 1/sqrt(D)); softcap (> 0:
      x = softcap·tanh(x / softcap)); local_window_size W (-1 off; a query sees the W most recent
      keys including its own); do_rotary, rotary_interleaved; smooth_softmax (1: sink logit 0);
      qk_output (1: logits after scale/softcap/bias, 2: probabilities; masked entries 0); causal
      (0: every row sees keys [0, T_b); needs local_window_size -1); sliding_window_cache (1:
      window-sized cache with onnxruntime's block eviction, rows [0, L(T_b)) hold the most recent
      positions, L(T) = T if T <= P else T - G·ceil((T - P) / G), G = P - W + 1);
      k_quant_type, v_quant_type ("NONE" | "PER_TENSOR" | "PER_CHANNEL", equal), kv_cache_bit_width
      (8 or 4 when quantised: quantised on write, dequantised on read); qk_norm_epsilon
      (q_norm_epsilon / k_norm_epsilon override it).
      shared_buffer: True models onnxruntime's shared past/present buffer: present is past with
        the new rows written in place at past_b (donate past_key/past_value to the jit and XLA
        reuses the buffer). False: a new present of length max(total, P), past rows [0, past_b)
        copied, zeros after the new rows. Ignored by a sliding-window cache (always capacity P).
      query_projection: the packed query as the projection that makes it (`QkvProjection`); the
        CUDA decode route of one row then computes both in one launch. Results are the same.
      past_empty: the caller guarantees that no row has a past (past_b = 0 and T_b <= S in every
        row: the first prompt on a fixed-capacity cache, as DecoderSession's prefill is). The
        attention then reads only the first S cache rows, and on a GPU a long prompt runs on
        cuDNN's flash attention (`jax.nn.dot_product_attention`) where it covers the call. Rows
        that break the promise get undefined outputs (never an out-of-bounds write).
      backend: "auto", "reference" or "cuda".

    Per batch row: past_b = 0 on a first prompt, else T_b - S (or T_b - query_seqlens[b]). Query s
    sits at position p = past_b + s and sees keys [max(0, L - W), L), L = min(p + 1, T_b)
    (causal) or T_b. Right padding (T_b < S on a first prompt) is native: a padded query has
    L = T_b (onnxruntime's f32 "flash" path alone counts a window back from p for those rows).
    Scores: scale·q·k -> softcap -> + bias -> mask -> softmax (with the sink in the max and the
    denominator) -> ·V, in float32; a quantised cache is read dequantised in float32.

    A query row with no visible key gives 0 (onnxruntime gives 0 or NaN depending on its code
    path; 0 is the documented choice). A batch row whose cache write or keys would fall outside
    the cache (seqlens_k beyond the capacity, or T_b < S on a later step: only the device knows)
    is not written, outputs 0 and gets status KV_WRITE_OUT_OF_RANGE.

    Raises ValueError / TypeError "group_query_attention: <input>: <rule>" at trace time for
    invalid shapes, dtypes, attributes and step types.
    """
    config, args, device = _prepare(locals())
    query, key, past_key, query_seqlens = args[0], args[1], args[3], args[15]
    seqlens_k = args[5]
    if device is None:
        cuda_fn, why = decode_paths.gqa_cuda(config, query=query, key=key, past_key=past_key,
                                             query_seqlens=query_seqlens,
                                             has_bias=args[9] is not None,
                                             has_sink=args[10] is not None)
    else:
        cuda_fn, why = None, ("total_sequence_length is only known on the device (traced): the "
                              "reference decides the step type there")
    fn = functools.partial(reference.group_query_attention, config=config,
                           total=None if device is None else device["total"])
    rule = partitioning.GROUP_QUERY_ATTENTION
    p = query_projection
    if (p is not None and cuda_fn is not None
            and decode_paths.projected_prepare_unsupported(config, *args, projection=p) is None):
        # The projection's operands join the call (the reference ignores them), without the op's
        # partitioning rule: the route is one row on one device (sessions take it without a mesh).
        cuda_fn = functools.partial(decode_paths.gqa_decode_projected, config=config,
                                    bits=p.bits, block_size=p.block_size, eps=p.norm_epsilon)
        ref_fn, n_args = fn, len(args)
        def fn(*a):
            return ref_fn(*a[:n_args])
        args = (*args, p.x, p.w, p.bias, p.norm_weight)
        rule = None
    result = GroupQueryAttentionOutput(*dispatch(OP, backend, fn, cuda_fn, *args,
                                                 unsupported=why, rule=rule))
    if device is not None:
        total = device.pop("total")
        fit = {k: device[k] for k in ("past_len", "has_past", "shared", "windowed")}
        ok = _total_ok(total, seqlens_k, **device)
        fits = _rows_fit(total, seqlens_k, **fit)
        flag = (st.flag_unless(ok, st.TOTAL_SEQUENCE_LENGTH_INVALID)
                | st.flag_unless(fits, st.KV_WRITE_OUT_OF_RANGE))
        result = result._replace(status=result.status | flag)
    return result
