"""NaN and Inf on the CUDA kernels, held to the reference (issue 16: no silent zero rows).

The rule (docs/attention.md, "NaN and Inf"): a fully masked row (no visible key) gives 0; a row
poisoned by a NaN or +inf logit (from Q, a K row the kernel reads, the bias) gives NaN, never 0.
Checked on every kernel path: the decode engine with one split, several splits (combine kernel) and
a cluster combine; the general kernel (every qk mode); GroupQueryAttention's gqa_prepare + engine;
ai.onnx Attention end to end. Rows past the valid length hold NaN too: they are never read.
"""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.decode import decode_attention
from jax_onnx_attn.ops.reference import general as general_reference
from jax_onnx_attn.testing import assert_close

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ml_dtypes.bfloat16]


def _same(got, want, dtype, what=""):
    got = np.asarray(got).astype(np.float32)
    want = np.asarray(want).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN places")
    ok = ~np.isnan(want)
    assert_close(np.where(ok, got, 0), np.where(ok, want, 0), dtype, err_msg=what)


def _poison(rng, q, k, v, lens, kind):
    """Poison one visible spot; returns the (batch, head) rows it must turn NaN."""
    b0 = 0
    n = int(lens[b0])
    if kind == "q_nan":
        q[b0, 1, 0, 3] = np.nan
    elif kind == "k_nan":
        k[b0, 0, rng.integers(0, n), 5] = np.nan
    elif kind == "k_inf":
        k[b0, 0, rng.integers(0, n), :] = np.inf
    elif kind == "v_nan":
        v[b0, 0, rng.integers(0, n), 7] = np.nan


@functools.cache
def _decode(backend, split_rows=None):
    kw = {} if split_rows is None or backend != "cuda" else {"split_rows": split_rows}
    return jax.jit(functools.partial(decode_attention, backend=backend, causal=False, **kw))


@pytest.mark.parametrize("kind", ["q_nan", "k_nan", "k_inf", "v_nan", "none"])
@pytest.mark.parametrize("split", [None, 64, 256], ids=["auto", "split64", "split256"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_decode_engine(dtype, split, kind):
    rng = np.random.default_rng(7)
    b, hq, hkv, s, d, c = 3, 8, 2, 1, 128, 1024
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, c, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, c, d)).astype(dtype)
    lens = np.array([900, 0, 333], np.int32)      # row 1: fully masked (no key)
    _poison(rng, q, k, v, lens, kind)
    for bi, n in enumerate(lens):                 # never read: NaN past the valid length
        k[bi, :, n:] = np.nan
        v[bi, :, n:] = np.nan
    got = _decode("cuda", split)(q, k, v, lens)
    want = _decode("reference")(q, k, v, lens)
    _same(got, want, dtype, f"{kind} split={split}")
    np.testing.assert_array_equal(np.asarray(got)[1].astype(np.float32), 0)
    if kind != "none":
        assert np.isnan(np.asarray(got)[0].astype(np.float32)).any(), "the poisoned row is not NaN"


@pytest.mark.parametrize("mode", [None, 0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["q_nan", "k_nan", "k_inf", "v_nan"])
def test_general_kernel(kind, mode):
    rng = np.random.default_rng(3)
    b, hq, hkv, s, d, dv, c = 2, 4, 2, 3, 72, 40, 200
    q = rng.standard_normal((b, hq, s, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, c, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, c, dv)).astype(np.float32)
    lens = np.array([150, 0], np.int32)
    _poison(rng, q, k, v, lens, kind)
    kw = dict(scale=0.2, qk_mode=mode)
    got_y, got_qk = jax.jit(functools.partial(cuda.general_attention, **kw))(q, k, v, lens)
    want_y, want_qk = jax.jit(functools.partial(general_reference.general_attention, **kw))(
        q, k, v, lens)
    _same(got_y, want_y, np.float32, f"{kind} y")
    if mode in (2, 3):  # modes 0 / 1 read every key (also past kv_len, random here)
        _same(got_qk, want_qk, np.float32, f"{kind} qk")
    np.testing.assert_array_equal(np.asarray(got_y)[1], 0)


@pytest.mark.parametrize("kind", ["q_nan", "k_nan", "k_inf", "v_nan"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=lambda t: np.dtype(t).name)
def test_onnx_attention_end_to_end(dtype, kind):
    """ops.attention on CUDA vs the reference backend (no mask: every key visible to every row, so
    the spec's NaN rows are the ones the kernels read)."""
    rng = np.random.default_rng(11)
    b, hq, hkv, s, p, d = 2, 8, 2, 1, 63, 64
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, s, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, s, d)).astype(dtype)
    pk = rng.standard_normal((b, hkv, p, d)).astype(dtype)
    pv = rng.standard_normal((b, hkv, p, d)).astype(dtype)
    _poison(rng, q, pk, pv, np.array([p, p]), kind)
    run = lambda backend: jax.jit(functools.partial(ops.attention, backend=backend))(
        q, k, v, past_key=pk, past_value=pv).y
    _same(run("cuda"), run("reference"), dtype, kind)


@pytest.mark.parametrize("kind", ["query_nan", "past_key_inf", "past_value_nan", "beyond_seqlens"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_gqa_decode(dtype, kind):
    rng = np.random.default_rng(5)
    b, n, hkv, d, cap = 2, 8, 2, 128, 512
    x = dict(query=rng.standard_normal((b, 1, n * d)).astype(dtype),
             key=rng.standard_normal((b, 1, hkv * d)).astype(dtype),
             value=rng.standard_normal((b, 1, hkv * d)).astype(dtype),
             past_key=rng.standard_normal((b, hkv, cap, d)).astype(dtype),
             past_value=rng.standard_normal((b, hkv, cap, d)).astype(dtype),
             seqlens_k=np.array([300, 40], np.int32))
    if kind == "query_nan":
        x["query"][0, 0, 5] = np.nan
    elif kind == "past_key_inf":
        x["past_key"][0, 1, 17, :] = np.inf
    elif kind == "past_value_nan":
        x["past_value"][0, 0, 200, 3] = np.nan
    x["past_key"][1, :, 41:] = np.nan       # past T_b of row 1: never read
    x["past_value"][1, :, 41:] = np.nan
    attrs = dict(num_heads=n, kv_num_heads=hkv, total_sequence_length=cap, shared_buffer=True)
    run = lambda backend: jax.jit(functools.partial(ops.group_query_attention, backend=backend,
                                                    **attrs))(**x).output
    got, want = run("cuda"), run("reference")
    _same(got, want, dtype, kind)
    assert not np.isnan(np.asarray(got)[1].astype(np.float32)).any()
    if kind != "beyond_seqlens":
        assert np.isnan(np.asarray(got)[0].astype(np.float32)).any()


def test_lengths_of_any_width_on_the_kernels():
    """64-bit lengths reach the kernels saturated, not wrapped: 2**33 + 2 is out of range."""
    rng = np.random.default_rng(0)
    cache = np.zeros((2, 2, 16, 64), np.float16)
    new = rng.standard_normal((2, 2, 1, 64)).astype(np.float16)
    start = np.array([2 ** 33 + 2, 3], np.int64)
    out, status = ops.kv_append(cache, new, start, backend="cuda")
    np.testing.assert_array_equal(np.asarray(status), [ops.status.KV_WRITE_OUT_OF_RANGE, 0])
    np.testing.assert_array_equal(np.asarray(out)[0], 0)
