"""NaN and Inf on the CUDA kernels, held to the reference backend (issue 16: no silent zero rows).

The rule (docs/attention.md, "NaN and Inf"): a fully masked row (no visible key) gives 0; a row
poisoned by a NaN or +inf logit (from Q, a K row the kernel reads, the bias) gives NaN, never 0.
Checked on every kernel path: the decode engine with one split, several splits merged by the
combine kernel, and merged inside a thread-block cluster (with and without a sink); the general
kernel (every qk mode); GroupQueryAttention's gqa_prepare + engine; ai.onnx Attention end to end.
Cache rows past the valid length hold NaN too: they are never read. `assert_close` matches the NaN
places (numpy's equal_nan) and compares the rest within the dtype's tolerance.
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

from gqa_decode_cases import gqa_inputs

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ml_dtypes.bfloat16]
KINDS = ["q_nan", "k_nan", "k_inf", "v_nan", "bias_nan"]


def _has_nan(x) -> bool:
    return bool(np.isnan(np.asarray(x).astype(np.float32)).any())


def _poison(rng, q, k, v, bias, n, kind):
    """Poisons one spot of batch row 0 that the rows reading it see (keys [0, n) visible)."""
    if kind == "q_nan":
        q[0, 1, 0, 3] = np.nan                       # query head 1
    elif kind == "k_nan":
        k[0, 0, rng.integers(0, n), 5] = np.nan      # every query head of KV head 0
    elif kind == "k_inf":
        k[0, 0, rng.integers(0, n), :] = np.inf      # q.k = inf - inf: NaN
    elif kind == "v_nan":
        v[0, 0, rng.integers(0, n), 7] = np.nan      # column 7 of KV head 0's heads
    elif kind == "bias_nan":
        bias[0, 0, 0, rng.integers(0, n)] = np.nan   # every head (the bias broadcasts over heads)


# The decode engine's ways to finish a row: (split_rows, cluster) for cuda.decode_attention.
DECODE_PLANS = {"single": (1024, False), "combine_kernel": (64, False), "cluster": (128, True),
                "auto": (None, None)}


@functools.cache
def _decode_jit(plan):
    split_rows, cluster = DECODE_PLANS[plan]
    return jax.jit(functools.partial(cuda.decode_attention, scale=0.1, causal=False,
                                     split_rows=split_rows, cluster=cluster))


_decode_reference = jax.jit(functools.partial(decode_attention, scale=0.1, causal=False,
                                              backend="reference"))


@pytest.mark.parametrize("sink", [False, True], ids=["no_sink", "sink"])
@pytest.mark.parametrize("kind", KINDS + ["none"])
@pytest.mark.parametrize("plan", DECODE_PLANS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_decode_engine(dtype, plan, kind, sink):
    rng = np.random.default_rng(7)
    b, hq, hkv, s, d, c = 3, 8, 2, 1, 128, 1024
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, c, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, c, d)).astype(dtype)
    bias = np.zeros((b, 1, s, c), np.float32) if kind == "bias_nan" else None
    lens = np.array([900, 0, 333], np.int32)      # row 1: no key, fully masked
    _poison(rng, q, k, v, bias, int(lens[0]), kind)
    for bi, n in enumerate(lens):                 # never read: NaN past the valid length
        k[bi, :, n:] = np.nan
        v[bi, :, n:] = np.nan
    sink_v = rng.standard_normal(hq).astype(np.float32) if sink else None
    got = np.asarray(_decode_jit(plan)(q, k, v, lens, bias, sink_v))
    want = np.asarray(_decode_reference(q, k, v, lens, bias, sink_v))
    assert_close(got, want, dtype, err_msg=f"{kind} {plan}")
    np.testing.assert_array_equal(got[1].astype(np.float32), 0)
    assert _has_nan(got[0]) == (kind != "none"), "the poisoned row must be NaN (and only it)"
    assert not _has_nan(got[1:])


@pytest.mark.parametrize("mode", [None, 0, 1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_general_kernel(kind, mode):
    rng = np.random.default_rng(3)
    b, hq, hkv, s, d, dv, c = 2, 4, 2, 3, 72, 40, 200
    q = rng.standard_normal((b, hq, s, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, c, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, c, dv)).astype(np.float32)
    bias = rng.standard_normal((b, 1, s, c)).astype(np.float32) if kind == "bias_nan" else None
    lens = np.array([150, 0], np.int32)
    _poison(rng, q, k, v, bias, int(lens[0]), kind)
    kw = dict(scale=0.2, qk_mode=mode)
    got_y, got_qk = jax.jit(functools.partial(cuda.general_attention, **kw))(q, k, v, lens, bias)
    want_y, want_qk = jax.jit(functools.partial(general_reference.general_attention, **kw))(
        q, k, v, lens, bias)
    assert_close(np.asarray(got_y), np.asarray(want_y), np.float32, err_msg=f"{kind} y")
    if mode is not None:
        # Modes 0 / 1 are defined on every key, also past kv_len (random here, NaN-free).
        assert_close(np.asarray(got_qk), np.asarray(want_qk), np.float32, err_msg=f"{kind} qk")
    np.testing.assert_array_equal(np.asarray(got_y)[1], 0)
    assert _has_nan(got_y)


@pytest.mark.parametrize("kind", ["q_nan", "k_nan", "k_inf", "v_nan", "mask_nan"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=lambda t: np.dtype(t).name)
def test_onnx_attention_end_to_end(dtype, kind):
    """ops.attention on CUDA (float16: the decode engine; float32: the general kernel) against
    the reference backend. Every key is visible to every row, so the spec's NaN rows are the ones
    the kernels read."""
    rng = np.random.default_rng(11)
    b, hq, hkv, s, p, d = 2, 8, 2, 1, 63, 64
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, s, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, s, d)).astype(dtype)
    pk = rng.standard_normal((b, hkv, p, d)).astype(dtype)
    pv = rng.standard_normal((b, hkv, p, d)).astype(dtype)
    mask = np.zeros((b, 1, s, p + s), np.float32) if kind == "mask_nan" else None
    _poison(rng, q, pk, pv, mask, p, kind.replace("mask", "bias"))
    run = lambda backend: jax.jit(functools.partial(ops.attention, backend=backend))(  # noqa: E731
        q, k, v, attn_mask=mask, past_key=pk, past_value=pv).y
    got = np.asarray(run("cuda"))
    assert_close(got, np.asarray(run("reference")), dtype, err_msg=kind)
    assert _has_nan(got[0]) and not _has_nan(got[1])


@pytest.mark.parametrize("kind", ["query_nan", "past_key_inf", "past_value_nan", "bias_nan",
                                  "beyond_seqlens"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_gqa_decode(dtype, kind):
    """GroupQueryAttention decode on a shared buffer (gqa_prepare + the engine). Batch row 0 is
    poisoned at a key it sees, row 1 is clean, row 2 is refused (seqlens_k beyond the capacity: 0);
    cache rows past T_b = seqlens_k + 1 hold NaN and are never read."""
    n, hkv, d, cap = 8, 2, 128, 512
    x = gqa_inputs(4, dtype, b=3, s=1, n=n, hkv=hkv, d=d, cap=cap, packed=False, bias=True)
    seqlens = x["seqlens_k"]
    seqlens[:2] = [300, 40]         # row 2 keeps its length beyond the capacity
    visible = int(seqlens[0]) // 2  # a past key row every query row of batch row 0 sees
    if kind == "query_nan":
        x["query"][0, 0, 5] = np.nan
    elif kind == "past_key_inf":
        x["past_key"][0, 1, visible, :] = np.inf
    elif kind == "past_value_nan":
        x["past_value"][0, 0, visible, 3] = np.nan
    elif kind == "bias_nan":
        x["attention_bias"][0, 2, 0, visible] = np.nan
    for bi, length in enumerate(seqlens[:2]):
        x["past_key"][bi, :, length + 1:] = np.nan
        x["past_value"][bi, :, length + 1:] = np.nan
    total = x.pop("total_sequence_length")
    attrs = dict(num_heads=n, kv_num_heads=hkv, total_sequence_length=total, shared_buffer=True)
    run = lambda backend: jax.jit(functools.partial(  # noqa: E731
        ops.group_query_attention, backend=backend, **attrs))(**x)
    got, want = run("cuda"), run("reference")
    out = np.asarray(got.output)
    assert_close(out, np.asarray(want.output), dtype, err_msg=kind)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))
    assert _has_nan(out[0]) == (kind != "beyond_seqlens")
    assert not _has_nan(out[1:])
    np.testing.assert_array_equal(out[2].astype(np.float32), 0)


def test_lengths_of_any_width_on_the_kernels():
    """64-bit lengths reach the kernels saturated, not wrapped: 2**33 + 2 is out of range."""
    rng = np.random.default_rng(0)
    cache = np.zeros((2, 2, 16, 64), np.float16)
    new = rng.standard_normal((2, 2, 1, 64)).astype(np.float16)
    start = np.array([2 ** 33 + 2, 3], np.int64)
    out, status = ops.kv_append(cache, new, start, backend="cuda")
    np.testing.assert_array_equal(np.asarray(status), [ops.status.KV_WRITE_OUT_OF_RANGE, 0])
    np.testing.assert_array_equal(np.asarray(out)[0], 0)
