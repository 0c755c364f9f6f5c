"""Feature axes of the decode-engine GPU sweeps (dense and quantised caches share them)."""

import functools
import itertools

import jax
import ml_dtypes
import numpy as np

from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.decode import decode_attention

BIASES = [None, "f32_full", "bool_b1s_short", "bf16_h1_long"]
WINDOWS = [(-1, -1), (37, -1), (0, -1), (-1, 5), (20, 3)]
#: (causal, (left, right), softcap, bias kind, sink)
FEATURES = list(itertools.product([True, False], WINDOWS, [0.0, 30.0], BIASES, [False, True]))


def bias(kind, rng, b, hq, s, c):
    """A bias of one BIASES kind for [B, Hq, S, C] caches: f32 with -inf holes and a fully masked
    row, a short broadcast bool keep-mask, or a bf16 bias longer than the cache."""
    if kind is None:
        return None
    if kind == "f32_full":
        x = (rng.standard_normal((b, hq, s, c)) * 2).astype(np.float32)
        x[rng.random(x.shape) < 0.1] = -np.inf
        x[0, 1, 0, :] = -np.inf  # a fully masked row
        return x
    if kind == "bool_b1s_short":
        return rng.random((b, 1, 1, c - 7)) < 0.8
    if kind == "bf16_h1_long":
        return rng.standard_normal((1, hq, s, c + 5)).astype(ml_dtypes.bfloat16)
    raise ValueError(kind)


# --- quantised caches (int8 / int4 with f32 scales): the shared inputs of the quantised sweeps ---

#: Scale magnitudes that give cache values of about +-4, like unit-scale data.
QUANT_SCALE_RANGE = {8: (0.01, 0.03), 4: (0.2, 0.5)}


def quant_cache(rng, bits, b, hkv, c, d):
    """A random int8 [B, Hkv, C, D] or packed int4 uint8 [B, Hkv, C, D / 2] cache (every byte
    random: rows past kv_len hold garbage)."""
    if bits == 8:
        return rng.integers(-128, 128, size=(b, hkv, c, d), dtype=np.int8)
    return rng.integers(0, 256, size=(b, hkv, c, d // 2), dtype=np.uint8)


def quant_scale(rng, bits, mode, hkv, d):
    """f32 scales per tensor [1] or per (KV head, channel) [1, Hkv, 1, D]."""
    lo, hi = QUANT_SCALE_RANGE[bits]
    shape = (1,) if mode == "tensor" else (1, hkv, 1, d)
    return rng.uniform(lo, hi, size=shape).astype(np.float32)


def quant_inputs(seed, bits, mode, b, hq, hkv, s, d, c, dtype, lens=None):
    """(rng, q, k, v, k_scale, v_scale, lens): q [B, Hq, S, D], quantised caches, scales, and
    lengths (random; row 0 full, row 1 shorter than S so early query rows see nothing)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k, v = quant_cache(rng, bits, b, hkv, c, d), quant_cache(rng, bits, b, hkv, c, d)
    ks, vs = quant_scale(rng, bits, mode, hkv, d), quant_scale(rng, bits, mode, hkv, d)
    if lens is None:
        lens = rng.integers(0, c + 1, size=b)
        lens[0] = c
        if b > 2:
            lens[1] = min(s - 1, c)  # fewer keys than queries: early rows see nothing
    return rng, q, k, v, ks, vs, np.asarray(lens, np.int32)


def dense_inputs(seed, b, hq, hkv, s, d, c, dtype, lens=None):
    """(rng, q, k, v, lens) over float caches [B, Hkv, C, D]; cache rows past a batch row's length
    hold NaN (nothing past kv_len may leak); lengths random with row 0 full, row 1 empty and row 2
    shorter than S (early query rows see nothing)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, c, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, c, d)).astype(dtype)
    if lens is None:
        lens = rng.integers(0, c + 1, size=b)
        lens[0] = c
        if b > 2:
            lens[1] = 0
            lens[2] = min(s - 1, c)  # fewer keys than queries: early rows see nothing
    lens = np.asarray(lens, np.int32)
    for bi, n in enumerate(lens):
        k[bi, :, max(n, 0):] = np.nan
        v[bi, :, max(n, 0):] = np.nan
    return rng, q, k, v, lens


def engine(q, k, v, lens, bias=None, sink=None, **static):
    """cuda.decode_attention jitted with `static` (options such as producer=, tile128=)."""
    f = jax.jit(functools.partial(cuda.decode_attention, **static))
    return np.asarray(f(q, k, v, lens, bias, sink))


def reference(q, k, v, lens, bias=None, sink=None, **static):
    """The reference backend of the same call."""
    f = jax.jit(functools.partial(decode_attention, backend="reference", **static))
    return np.asarray(f(q, k, v, lens, bias, sink))


def nan_inf_inputs(d):
    """(q, k, v, lens) of the NaN / Inf semantics check (docs/attention.md "NaN and Inf"): f16, B=4,
    32/8 heads, S=1, capacity 1000, lengths 1000 / 700 / 333 / 64; a NaN key visible to query heads
    4-7 of row 0, a +inf value in column 3 of heads 8-11 of row 1, NaN keys 0-129 of row 2 (visible
    without a window; with left 200 its keys start at 132, inside the tile of rows 128-191 / 128-255),
    NaN past every row's length."""
    _, q, k, v, lens = dense_inputs(d, 4, 32, 8, 1, d, 1000, np.float16, lens=[1000, 700, 333, 64])
    k[0, 1, 900] = np.nan
    v[1, 2, 600, 3] = np.inf
    k[2, :, :130] = np.nan
    return q, k, v, lens


def check_nan_inf(got, left):
    """What `nan_inf_inputs` must give with scale 0.1, causal, window left `left` (-1: none)."""
    got32 = np.asarray(got).astype(np.float32)
    assert np.isnan(got32[0, 4:8]).all() and not np.isnan(got32[0, :4]).any()
    assert not np.isfinite(got32[1, 8:12, :, 3]).any()
    assert np.isfinite(np.delete(got32[1], 3, axis=-1)).all()
    assert np.isnan(got32[2]).all() if left < 0 else np.isfinite(got32[2]).all()
    assert np.isfinite(got32[3]).all()
