"""Reference com.microsoft::GroupQueryAttention: the executable spec of the CUDA handler.

A clean function of arrays plus a static `GQAConfig`; `jax_onnx_attn.ops.group_query_attention`
validates and normalises the inputs first. Semantics follow onnxruntime's CPU kernel (see
docs in the public op), per batch row b:

  T_b    = seqlens_k[b] + 1                       tokens in the cache after this step
  past_b = 0 (first prompt), T_b - query_seqlens[b] (when given), else T_b - S
  query s sits at absolute position p = past_b + s and sees keys [max(0, L - W), L) with
  L = min(p + 1, T_b) (causal) or T_b (causal=0), W = local_window_size (-1: no window).
  New K/V (K after q/k-norm and rotary, then quantised) are written at rows [past_b, past_b + S).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jax_onnx_attn.ops import status as st
from jax_onnx_attn.ops.reference import core, quant
from jax_onnx_attn.ops.reference.kv_cache import kv_append
from jax_onnx_attn.ops.reference.norm import rms_norm
from jax_onnx_attn.ops.reference.rotary import rotary_embedding


@dataclasses.dataclass(frozen=True)
class GQAConfig:
    """The static part of a GroupQueryAttention call (attributes resolved, shapes decided).

    scale is resolved (never 0); kv_bits is 0 (float cache), 4 or 8; present_length is the sequence
    dimension of present_key (the cache capacity for a shared or sliding-window cache).
    """
    num_heads: int
    kv_num_heads: int
    head_size: int
    total_sequence_length: int
    present_length: int
    scale: float
    softcap: float = 0.0
    local_window_size: int = -1
    do_rotary: bool = False
    rotary_interleaved: bool = False
    smooth_softmax: bool = False
    qk_output: int = 0
    causal: bool = True
    sliding_window_cache: bool = False
    kv_bits: int = 0
    q_norm_epsilon: float = 1e-6
    k_norm_epsilon: float = 1e-6
    shared_buffer: bool = False
    #: S == total_sequence_length; None when total is only known on the device (the reference then
    #: gets it as `total` and decides per call).
    first_prompt: bool | None = False
    #: The caller guarantees every row's past is empty (past_b = 0, T_b <= S): the attention reads
    #: only the first S cache rows (a fixed-capacity cache's first prompt).
    past_empty: bool = False


def resident_length(t, capacity: int, window: int):
    """Rows a sliding-window cache holds after t tokens (onnxruntime's block eviction).

    G = C - W + 1 rows are evicted at once: L(t) = t if t <= C else t - G * ceil((t - C) / G),
    so min(t, W) <= L(t) <= min(t, C).

    Args:
      t: integer array (int32 [B] per batch row, or a scalar), tokens seen so far; t >= 0.
      capacity: C, the cache's rows (Python int).
      window: W, local_window_size (Python int, 0 < W <= C).

    Returns:
      L(t), t's shape and dtype.
    """
    g = capacity - window + 1
    over = jnp.maximum(t - capacity, 0)
    return t - g * ((over + g - 1) // g)


def _to_bnsd(x, heads: int, d: int):
    b, s, _ = x.shape
    return x.reshape(b, s, heads, d).transpose(0, 2, 1, 3)


def split_heads(query, key, value, config: GQAConfig):
    """query [B, S, N·D] (or packed Q|K|V) and key/value [B, K, Hkv·D] -> q [B, N, S, D],
    k, v [B, Hkv, K, D]."""
    n, hkv, d = config.num_heads, config.kv_num_heads, config.head_size
    if key is None:
        query, key, value = jnp.split(query, [n * d, (n + hkv) * d], axis=-1)
    return _to_bnsd(query, n, d), _to_bnsd(key, hkv, d), _to_bnsd(value, hkv, d)


def first_prompt_flag(config: GQAConfig, total, s: int):
    """Whether the step is a first prompt: config.first_prompt, or, when that is None, the device's
    `total == S` (bool [])."""
    if config.first_prompt is not None:
        return config.first_prompt
    return jnp.asarray(total).reshape(()) == s


def step_lengths(seqlens_k, query_seqlens, s: int, kv_len: int, config: GQAConfig, total=None):
    """Per-batch lengths of one step, int32 [B] each: (T_b, past_b, new_b, valid).

    T_b = seqlens_k + 1 tokens after the step; past_b = 0 on a first prompt, T_b - query_seqlens
    when given, else T_b - S; new_b = tokens appended (0 for a KV-shared layer). valid is False
    where only the device can see the lengths are impossible (the row is then refused).
    total: the traced total_sequence_length when config.first_prompt is None.
    """
    total_b = seqlens_k.astype(jnp.int32) + 1
    first = first_prompt_flag(config, total, s)
    if query_seqlens is not None:
        new_b = query_seqlens.astype(jnp.int32)
        past_b = total_b - new_b
    elif not isinstance(first, bool):
        past_b = jnp.where(first, 0, total_b - s)
        new_b = jnp.where(first, total_b, s)
    elif first:
        past_b = jnp.zeros_like(total_b)
        new_b = total_b
    else:
        past_b = total_b - s
        new_b = jnp.full_like(total_b, s)
    if kv_len == 0:
        # KV-shared layer: the cache already holds all T_b tokens; nothing is appended.
        new_b = jnp.zeros_like(total_b)
    # A chunk that would start before position 0, or that claims more new tokens than it has.
    valid = past_b >= 0
    if query_seqlens is not None or config.sliding_window_cache:
        valid = valid & (new_b >= 0) & (new_b <= kv_len)
    return total_b, past_b, new_b, valid


def normalize_and_rotate(q, k, past_b, cos_cache, sin_cache, position_ids, q_norm_weight,
                         k_norm_weight, has_query_seqlens: bool, config: GQAConfig, first=None):
    """q/k norm (per-head RMSNorm over D) then rotary on q [B, N, S, D] and k [B, Hkv, S, D].

    Rotary positions: position_ids[b, s] when given (only position_ids[0, 0] + s on a first
    prompt, onnxruntime's behaviour), else past_b + s.
    """
    c = config
    if q_norm_weight is not None:
        q = rms_norm(q, q_norm_weight, c.q_norm_epsilon)
        k = rms_norm(k, k_norm_weight, c.k_norm_epsilon)
    if c.do_rotary:
        b, _, s, _ = q.shape
        steps = jnp.arange(s, dtype=jnp.int32)
        if position_ids is None:
            positions = past_b[:, None] + steps
        else:
            first = c.first_prompt if first is None else first
            given = position_ids.astype(jnp.int32)
            quirk = jnp.broadcast_to(given[0, 0] + steps, (b, s))
            if has_query_seqlens or first is False:
                positions = given
            elif first is True:
                positions = quirk
            else:
                positions = jnp.where(first, quirk, given)
        rope = dict(interleaved=c.rotary_interleaved)
        q = rotary_embedding(q, cos_cache, sin_cache, positions, **rope)
        if k.shape[2]:  # a KV-shared layer has no new keys to rotate
            k = rotary_embedding(k, cos_cache, sin_cache, positions, **rope)
    return q, k


def _store(x, scale, cfg: GQAConfig, cache_dtype):
    """New K or V rows [B, Hkv, S, D] in the cache's element type (quantised when kv_bits)."""
    if cfg.kv_bits:
        return quant.quantize(x, scale, cfg.kv_bits)
    return x.astype(cache_dtype)


def _load(cache, scale, cfg: GQAConfig, dtype):
    """Cache rows as the attention reads them: dequantised to the op's dtype when kv_bits."""
    if cfg.kv_bits:
        return quant.dequantize(cache, scale, cfg.kv_bits, dtype)
    return cache


def prepare_step(query, key, value, k_cache, v_cache, seqlens_k, cos_cache=None, sin_cache=None,
                 position_ids=None, q_norm_weight=None, k_norm_weight=None, k_scale=None,
                 v_scale=None, *, num_heads: int, kv_num_heads: int,
                 rotary_interleaved: bool = False, q_norm_epsilon: float = 1e-6,
                 k_norm_epsilon: float = 1e-6, kv_bits: int = 0):
    """A decode / verify step's preparation on a shared fixed-capacity cache: the executable spec of
    the `gqa_prepare` CUDA kernel, composed from this module's own steps.

    split_heads; q/k norm then rotary (normalize_and_rotate, positions past_b + s or
    position_ids); the new K/V rows (quantised when kv_bits) written in place at rows
    [past_b, past_b + S), past_b = seqlens_k[b] + 1 - S, by kv_append, which refuses a batch row
    whose rows do not all fit in [0, C).

    Args (B batch, S new rows, N / Hkv heads, D head size, C capacity, T the query's dtype):
      query: [B, S, N·D] T, or packed [B, S, (N + 2·Hkv)·D] when key and value are None.
      key, value: [B, S, Hkv·D] T, or None (packed).
      k_cache, v_cache: [B, Hkv, C, D] T; int8 for kv_bits 8; uint8 [B, Hkv, C, D/2] for kv_bits 4.
      seqlens_k: int32 [B], T_b - 1.
      cos_cache, sin_cache: [max_position, R/2] T (rotary on the first R features), or None.
      position_ids: integer [B, S] rotary positions (clipped to the table), or None.
      q_norm_weight, k_norm_weight: [D] T (per-head RMS norm before rotary), or None.
      k_scale, v_scale: float32 of one element, or Hkv·D elements ([1, Hkv, 1, D]), when kv_bits.
      num_heads, kv_num_heads, rotary_interleaved, q_norm_epsilon, k_norm_epsilon, kv_bits: the
        op's attributes.

    Returns:
      (q [B, N, S, D] T, k_cache, v_cache, status int32 [B]); a refused row keeps its cache rows
      and gets KV_WRITE_OUT_OF_RANGE (its q is computed all the same).
    """
    n, hkv = num_heads, kv_num_heads
    s, hidden = query.shape[1:]
    d = hidden // (n if key is not None else n + 2 * hkv)
    capacity = k_cache.shape[2]
    # A decode step on a shared cache; the fields the preparation does not read are neutral.
    cfg = GQAConfig(num_heads=n, kv_num_heads=hkv, head_size=d, total_sequence_length=capacity,
                    present_length=capacity, scale=1.0, do_rotary=cos_cache is not None,
                    rotary_interleaved=bool(rotary_interleaved), kv_bits=kv_bits,
                    q_norm_epsilon=q_norm_epsilon, k_norm_epsilon=k_norm_epsilon,
                    shared_buffer=True)
    q, k, v = split_heads(query, key, value, cfg)
    _, past_b, _, _ = step_lengths(seqlens_k, None, s, s, cfg)
    q, k = normalize_and_rotate(q, k, past_b, cos_cache, sin_cache, position_ids, q_norm_weight,
                                k_norm_weight, False, cfg)

    def channel_scale(x):
        if x is None:
            return None
        return x.reshape(()) if x.size == 1 else x.reshape(1, hkv, 1, d)

    k_new = _store(k, channel_scale(k_scale), cfg, k_cache.dtype)
    v_new = _store(v, channel_scale(v_scale), cfg, v_cache.dtype)
    k_cache, status = kv_append(k_cache, k_new, past_b)
    v_cache, _ = kv_append(v_cache, v_new, past_b)
    return q, k_cache, v_cache, status


def _bias_columns(bias, key_pos, length: int):
    """attention_bias [B|1, N|1, S, total] at the absolute key positions of the cache rows.

    key_pos None: rows are absolute positions 0 .. length-1 (slice, or pad with zeros when the
    cache is longer than total: a static cache whose seqlens_k exceeds total - 1 gets no bias).
    Otherwise key_pos int32 [B, K] (sliding-window cache): a gather per batch row.
    """
    total = bias.shape[-1]
    if key_pos is None:
        if length <= total:
            return bias[..., :length]
        return jnp.pad(bias, [(0, 0)] * 3 + [(0, length - total)])
    bsz, k = key_pos.shape
    bias = jnp.broadcast_to(bias, (bsz,) + bias.shape[1:])
    idx = jnp.clip(key_pos, 0, total - 1)[:, None, None, :]
    got = jnp.take_along_axis(bias, jnp.broadcast_to(idx, bias.shape[:3] + (k,)), axis=-1)
    inside = (key_pos < total)[:, None, None, :]
    return jnp.where(inside, got, jnp.zeros_like(got))


def _absolute_columns(scores, key_pos, width: int):
    """Scores [B, N, S, K] over cache rows -> [B, N, S, width] over absolute key positions.

    Entries of no cache row are 0 (so are masked ones: the caller zeroed them).
    """
    k = scores.shape[-1]
    if key_pos is None:
        return scores[..., :width] if k >= width else jnp.pad(
            scores, [(0, 0)] * 3 + [(0, width - k)])
    # Sliding-window rows hold distinct positions: a one-hot product places each at its column.
    onehot = key_pos[:, :, None] == jnp.arange(width, dtype=jnp.int32)[None, None, :]
    return jnp.einsum("bnsk,bkw->bnsw", scores, onehot.astype(scores.dtype),
                      precision=lax.Precision.HIGHEST)


def group_query_attention(query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache,
                          position_ids, attention_bias, head_sink, k_scale, v_scale, q_norm_weight,
                          k_norm_weight, query_seqlens, *, config: GQAConfig, total=None):
    """GroupQueryAttention on validated inputs.

    Args (B batch, S query length, N / Hkv heads, D head size, P past capacity, K new KV rows):
      query: [B, S, N·D], or packed [B, S, (N + 2·Hkv)·D] when key and value are None.
      key, value: [B, K, Hkv·D] (K = S, or 0 for a KV-shared layer) or None (packed).
      past_key, past_value: [B, Hkv, P, D] (D/2 uint8 for int4) or None.
      seqlens_k: int32 [B]; query_seqlens: int32 [B] or None.
      cos_cache, sin_cache: [max_position, R/2] or None (no rotary).
      position_ids: int [B, S] or None.
      attention_bias: [B|1, N|1, S, total_sequence_length] or None.
      head_sink: [N] or None. k_scale, v_scale: float32 broadcastable to the cache, or None.
      q_norm_weight, k_norm_weight: [D] or None.
      config: the static attributes (GQAConfig).
      total: total_sequence_length as a traced int32 [] when only the device knows it
        (config.first_prompt is None: the step type is decided by total == S); else None.

    Returns:
      (output [B, S, N·D], present_key, present_value [B, Hkv, present_length, D or D/2],
       output_qk [B, N, S, total_sequence_length] or None, status int32 [B]).
    """
    c = config
    dtype = query.dtype
    n, d = c.num_heads, c.head_size
    b, s = query.shape[:2]
    q, k, v = split_heads(query, key, value, c)
    kv_len = k.shape[2]
    total_b, past_b, new_b, valid = step_lengths(seqlens_k, query_seqlens, s, kv_len, c, total)
    q, k = normalize_and_rotate(q, k, past_b, cos_cache, sin_cache, position_ids, q_norm_weight,
                                k_norm_weight, query_seqlens is not None, c,
                                first_prompt_flag(c, total, s))

    cache_dtype = past_key.dtype if past_key is not None else dtype
    k_new = _store(k, k_scale, c, cache_dtype)
    v_new = _store(v, v_scale, c, cache_dtype)
    kv = _sliding_window_kv if c.sliding_window_cache else _full_kv
    keys, values, present_k, present_v, key_pos, key_ok, ok = kv(
        past_key, past_value, k_new, v_new, past_b, total_b, new_b, valid, cache_dtype, c)
    status = st.kv_write_status(ok)
    if c.past_empty and key_pos is None and not c.qk_output:
        # Rows >= S hold no visible key (T_b <= S): S x S logits instead of S x capacity.
        keys, values = keys[:, :, :s], values[:, :, :s]
    keys = _load(keys, k_scale, c, core.accumulation_dtype(dtype))
    values = _load(values, v_scale, c, core.accumulation_dtype(dtype))

    # Visible keys of query s: absolute positions [max(0, L - W), L); a padded query (p >= T_b)
    # has L = T_b and sees the last W keys, as onnxruntime's general path does.
    q_pos = past_b[:, None] + jnp.arange(s, dtype=jnp.int32)                       # [B, S]
    if c.causal:
        limit = jnp.minimum(q_pos + 1, total_b[:, None])
    else:
        limit = jnp.broadcast_to(total_b[:, None], (b, s))
    limit = limit[:, None, :, None]                                                  # [B, 1, S, 1]
    rows = keys.shape[2]
    if key_pos is None:
        pos = jnp.arange(rows, dtype=jnp.int32)[None, None, None, :]
        visible = pos < limit
    else:
        pos = key_pos[:, None, None, :]                                              # [B, 1, 1, K]
        visible = key_ok[:, None, None, :] & (pos < limit)
    if c.local_window_size >= 0:
        visible = visible & (pos >= limit - c.local_window_size)

    # Rows past T_b (or not resident) hold no token and are never read, whatever they hold (NaN
    # included), as onnxruntime reads only [0, T_b): their K never reaches a logit (the select
    # below) and their V is zeroed, so that 0 * NaN cannot reach the output.
    if key_pos is None:
        readable = pos < total_b[:, None, None, None]
    else:
        readable = key_ok[:, None, None, :]
    values = jnp.where(jnp.swapaxes(readable, -1, -2), values, jnp.zeros((), values.dtype))
    x = core.logits(q, keys, c.scale)
    x = core.apply_softcap(x, c.softcap)
    if attention_bias is not None:
        x = x + _bias_columns(attention_bias, key_pos, rows).astype(x.dtype)
    x = jnp.where(visible, x, -jnp.inf)
    if head_sink is not None:
        sink = head_sink.astype(x.dtype)[None, :, None, None]
    elif c.smooth_softmax:
        sink = jnp.zeros((), x.dtype)
    else:
        sink = None
    p = core.softmax(x, sink)
    y = core.weighted_values(p, values)
    # A row whose cache write was refused has no keys it could trust: it gives 0.
    y = jnp.where(ok[:, None, None, None], y, jnp.zeros_like(y))
    output = y.transpose(0, 2, 1, 3).reshape(b, s, n * d).astype(dtype)

    output_qk = None
    if c.qk_output:
        shown = jnp.where(visible, x, jnp.zeros_like(x)) if c.qk_output == 1 else p
        output_qk = _absolute_columns(shown, key_pos, c.total_sequence_length).astype(dtype)
    return output, present_k, present_v, output_qk, status


def _full_kv(past_key, past_value, k_new, v_new, past_b, total_b, new_b, valid, cache_dtype,
             c: GQAConfig):
    """Full-length cache: row j holds absolute position j.

    Shared buffer: present is past with rows [past_b, past_b + K) written in place. Otherwise
    present [B, Hkv, max(total, P), D] holds past rows [0, past_b), the new rows, zeros elsewhere.
    Returns (keys, values, present_k, present_v, key_pos=None, key_ok=None, ok [B]).
    """
    b, hkv, kv_len, dc = k_new.shape
    length = c.present_length
    if past_key is not None and c.shared_buffer:
        base_k, base_v = past_key, past_value
    else:
        base_k = jnp.zeros((b, hkv, length, dc), cache_dtype)
        base_v = jnp.zeros((b, hkv, length, dc), cache_dtype)
        if past_key is not None:
            # KV-shared layers (no new rows) keep all T_b cached rows.
            cached = past_b if kv_len else total_b
            keep = jnp.arange(past_key.shape[2])[None, None, :, None] < cached[:, None, None, None]
            base_k = lax.dynamic_update_slice(
                base_k, jnp.where(keep, past_key, jnp.zeros_like(past_key)), (0, 0, 0, 0))
            base_v = lax.dynamic_update_slice(
                base_v, jnp.where(keep, past_value, jnp.zeros_like(past_value)), (0, 0, 0, 0))
    # A row is refused (not written, output 0) when its write or its keys would leave the cache.
    ok = valid & (past_b + kv_len <= length) & (total_b <= length)
    if kv_len:
        start = jnp.where(ok, past_b, -1)  # -1: kv_append skips the row.
        present_k, _ = kv_append(base_k, k_new, start)
        present_v, _ = kv_append(base_v, v_new, start)
    else:
        present_k, present_v = base_k, base_v
    return present_k, present_v, present_k, present_v, None, None, ok


def _sliding_window_kv(past_key, past_value, k_new, v_new, past_b, total_b, new_b, valid,
                       cache_dtype, c: GQAConfig):
    """Window-sized cache with onnxruntime's block eviction.

    Before the step rows [0, L(past_b)) hold absolute positions past_b - L(past_b) ... past_b - 1.
    The attention reads those rows followed by the new ones (a staging buffer of C + K rows, so a
    step may be longer than the capacity); present keeps the last L(T_b) of them at rows [0, L)
    and the past's rows [L, C) (onnxruntime leaves them unspecified; its shared buffer keeps them).
    Returns (keys, values, present_k, present_v, key_pos [B, C+K], key_ok [B, C+K], ok [B]).
    """
    b, hkv, kv_len, dc = k_new.shape
    cap, w = past_key.shape[2], c.local_window_size
    # Tokens cached before the step (all T_b for a KV-shared layer, which appends nothing).
    cached = past_b if kv_len else total_b
    had = resident_length(jnp.maximum(cached, 0), cap, w)
    ok = valid
    pad = jnp.zeros((b, hkv, kv_len, dc), past_key.dtype)
    stage_k = jnp.concatenate([past_key, pad], axis=2)
    stage_v = jnp.concatenate([past_value, pad], axis=2)
    if kv_len:
        start = jnp.where(ok, had, -1)
        stage_k, _ = kv_append(stage_k, k_new, start)
        stage_v, _ = kv_append(stage_v, v_new, start)
    rows = jnp.arange(cap + kv_len, dtype=jnp.int32)[None, :]
    filled = had + new_b                                   # valid staging rows
    key_pos = (cached - had)[:, None] + rows               # absolute position of each row
    key_ok = rows < filled[:, None]
    # Keep the last L(T_b) valid rows, moved to row 0.
    keep = resident_length(total_b, cap, w)
    shift = jnp.where(ok, filled - keep, 0)
    src = jnp.clip(rows[:, :cap] + shift[:, None], 0, cap + kv_len - 1)   # [B, C]
    # Rows [L, C) keep the past's values, as onnxruntime's in-place (shared) buffer does; so does
    # every row of a refused batch row.
    moved = (rows[:, :cap] < keep[:, None]) & ok[:, None]
    moved = moved[:, None, :, None]
    present_k = jnp.where(moved, jnp.take_along_axis(stage_k, src[:, None, :, None], axis=2), past_key)
    present_v = jnp.where(moved, jnp.take_along_axis(stage_v, src[:, None, :, None], axis=2),
                          past_value)
    return stage_k, stage_v, present_k, present_v, key_pos, key_ok, ok
