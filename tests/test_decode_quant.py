"""decode_attention over int8 / int4 KV caches (kv_bits 8 / 4) on CPU: the reference path against a
float64 NumPy oracle that dequantises by hand, the trace-time errors, and the split plan for quantised
caches (asked from the extension: ffi/kernels/decode/plan.h)."""

import itertools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import decode_oracle
from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.decode import decode_attention
from jax_onnx_attn.testing import assert_close

FEATURES = list(itertools.product(
    [True, False],                                   # causal
    [(-1, -1), (3, -1), (-1, 2)],                    # (left, right)
    [0.0, 2.5],                                      # softcap
    [None, "f32"],                                   # bias
    [False, True],                                   # sink
))


def _dequantize_by_hand(cache, scale, bits, dtype):
    """int8 [..., D] or uint8 [..., D/2] (low nibble first, + 8) -> dtype, value * (scale or 1)."""
    if bits == 8:
        values = cache.astype(np.int32)
    else:
        values = np.empty(cache.shape[:-1] + (2 * cache.shape[-1],), np.int32)
        values[..., 0::2] = (cache & 15).astype(np.int32) - 8
        values[..., 1::2] = (cache >> 4).astype(np.int32) - 8
    s = np.asarray(scale, np.float32)
    s = np.where(s == 0, np.float32(1), s)
    return (values.astype(np.float32) * s).astype(dtype)


def _case(seed, bits, mode, dtype, b=3, hq=4, hkv=2, s=3, d=8, c=11):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    shape = (b, hkv, c, d) if bits == 8 else (b, hkv, c, d // 2)
    lo, hi = (-128, 128) if bits == 8 else (0, 256)
    store = np.int8 if bits == 8 else np.uint8
    k = rng.integers(lo, hi, size=shape).astype(store)  # every byte random, past kv_len too
    v = rng.integers(lo, hi, size=shape).astype(store)
    span = (0.005, 0.02) if bits == 8 else (0.1, 0.3)
    scale_shape = (1,) if mode == "tensor" else (1, hkv, 1, d)
    ks = rng.uniform(*span, size=scale_shape).astype(np.float32)
    vs = rng.uniform(*span, size=scale_shape).astype(np.float32)
    if mode == "channel_zeros":  # 0 reads as 1: keep those channels' values small
        ks.flat[::5] = 0.0
        vs.flat[1::7] = -0.0
        k = (k // 16).astype(store) if bits == 8 else k
    lens = np.array([c, 0, 7][:b], np.int32)
    return rng, q, k, v, ks, vs, lens


@pytest.mark.parametrize("causal,window,softcap,bias_kind,sink", FEATURES)
@pytest.mark.parametrize("mode", ["tensor", "channel", "channel_zeros"])
@pytest.mark.parametrize("bits", [8, 4])
def test_reference_matches_oracle_f32(bits, mode, causal, window, softcap, bias_kind, sink):
    rng, q, k, v, ks, vs, lens = _case(17, bits, mode, np.float32)
    b, hq, s, _ = q.shape
    c = k.shape[2]
    bias = rng.standard_normal((b, 1, s, c + 2)).astype(np.float32) if bias_kind else None
    sink_v = rng.standard_normal(hq).astype(np.float32) if sink else None
    kw = dict(scale=0.4, softcap=softcap, causal=causal, left=window[0], right=window[1])
    got = decode_attention(q, k, v, lens, bias, sink_v, ks, vs, kv_bits=bits, backend="reference",
                           **kw)
    kd, vd = (_dequantize_by_hand(x, sc, bits, np.float32) for x, sc in ((k, ks), (v, vs)))
    want = decode_oracle.decode_attention(q, kd, vd, lens, bias, sink_v, **kw)
    assert_close(got, want, np.float32)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("mode", ["tensor", "channel"])
@pytest.mark.parametrize("bits", [8, 4])
def test_reference_matches_oracle_half(bits, mode, dtype):
    # The oracle reads the cache as the kernel must: float32(x) * scale rounded once to the dtype.
    rng, q, k, v, ks, vs, lens = _case(18, bits, mode, dtype, s=2, d=16, c=40)
    kw = dict(scale=0.25, left=20)
    got = decode_attention(q, k, v, lens, None, None, ks, vs, kv_bits=bits, backend="reference", **kw)
    assert got.dtype == jnp.dtype(dtype)
    kd, vd = (_dequantize_by_hand(x, sc, bits, dtype) for x, sc in ((k, ks), (v, vs)))
    want = decode_oracle.decode_attention(q, kd, vd, lens, **kw)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_rounding_is_per_value_to_the_query_dtype(bits):
    # Dequantised values rounded once to bf16 (not kept in float32): equal to the dense op on the
    # hand-dequantised cache, bit for bit.
    _, q, k, v, ks, vs, lens = _case(19, bits, "channel", ml_dtypes.bfloat16, d=16, c=20)
    got = decode_attention(q, k, v, lens, None, None, ks, vs, kv_bits=bits, scale=0.3,
                           backend="reference")
    kd, vd = (_dequantize_by_hand(x, sc, bits, ml_dtypes.bfloat16) for x, sc in ((k, ks), (v, vs)))
    dense = decode_attention(q, kd, vd, lens, scale=0.3, backend="reference")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(dense))


def _err(match, exc=ValueError, *, q=None, k=None, v=None, ks="ok", vs="ok", bits=8):
    q = jnp.zeros((1, 4, 1, 16), jnp.float16) if q is None else q
    k = jnp.zeros((1, 2, 5, 16), jnp.int8) if k is None else k
    v = k if v is None else v
    ks = jnp.ones((1,), jnp.float32) if isinstance(ks, str) else ks
    vs = jnp.ones((1, 2, 1, 16), jnp.float32) if isinstance(vs, str) else vs
    with pytest.raises(exc, match=match):
        decode_attention(q, k, v, jnp.array([3]), None, None, ks, vs, kv_bits=bits)


def test_trace_time_errors_name_the_input():
    u4 = jnp.zeros((1, 2, 5, 8), jnp.uint8)
    _err("kv_bits must be 0", bits=3)
    _err("k_cache must be int8", TypeError, k=jnp.zeros((1, 2, 5, 16), jnp.float16))
    _err("v_cache must be int8", TypeError, v=jnp.zeros((1, 2, 5, 16), jnp.uint8))
    _err("k_cache must be uint8", TypeError, k=jnp.zeros((1, 2, 5, 8), jnp.int8), v=u4, bits=4)
    _err(r"D/2=8", k=jnp.zeros((1, 2, 5, 16), jnp.uint8), bits=4)           # int4 rows hold D/2
    _err("must be even", q=jnp.zeros((1, 4, 1, 15), jnp.float16), k=u4, bits=4)
    _err("k_scale is required", ks=None)
    _err("v_scale is required", vs=None)
    _err("k_scale must be float32", TypeError, ks=jnp.ones((1,), jnp.float16))
    _err(r"v_scale must have 1 element .* \[1, 2, 1, 16\]", vs=jnp.ones((2, 16), jnp.float32))
    _err(r"k_scale must have 1 element", ks=jnp.ones((1, 2, 1, 8), jnp.float32))
    _err("k_scale is for quantised caches", ks=jnp.ones((1,), jnp.float32), vs=None, bits=0,
         k=jnp.zeros((1, 2, 5, 16), jnp.float16))
    _err("k_cache must be one of", TypeError, k=jnp.zeros((1, 2, 5, 16), jnp.int8),
         ks=None, vs=None, bits=0)


@pytest.mark.parametrize("bits", [0, 8, 4])
@pytest.mark.parametrize("batch,rows,capacity,d", [(1, 4, 1024, 128), (1, 4, 131072, 128),
                                                  (8, 64, 16384, 128), (128, 4, 4096, 256),
                                                  (3, 200, 333, 80)])
def test_split_plan_is_valid(batch, rows, capacity, d, bits):
    sr = cuda.decode_split_rows(batch, 8, rows, capacity, d, bits)
    assert sr % cuda.DECODE_BLOCK_N == 0 and sr > 0
    assert -(-capacity // sr) <= cuda.DECODE_MAX_SPLITS
