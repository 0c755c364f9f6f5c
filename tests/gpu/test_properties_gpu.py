"""Property-based tests (hypothesis) on the GPU: the CUDA backend of both operators against their
reference backend on random calls the kernels cover (decode / verify steps), NaN / Inf included.

`pytest -m gpu` runs a few dozen derandomised examples of each; `pytest -m "gpu and slow"` many more
with fresh randomness (as tests/test_properties.py on CPU). A failing example found by either is
kept below as a regression case.

Poison goes where the kernels read: keys the lengths, causal bound or window hide are never read by
the kernels (their K cannot poison a row there as NaN + -inf does in the spec), so a poisoned cache
row is one every query row of the step sees; a mask's hidden keys are read and follow the spec.
"""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_onnx_attn import ops
from jax_onnx_attn.testing import assert_close

pytestmark = pytest.mark.gpu

GPU = settings(max_examples=40, deadline=None, derandomize=True, database=None,
               suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=400, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


@st.composite
def gqa_decode_calls(draw):
    """(inputs, attributes, dtype) of a GroupQueryAttention decode / verify step (shared buffer)."""
    dtype = draw(st.sampled_from(["float16", "bfloat16"]))
    d = draw(st.sampled_from([64, 128, 256]))
    hkv = draw(st.sampled_from([1, 2, 4]))
    n = hkv * draw(st.sampled_from([1, 2, 4, 8]))
    b = draw(st.integers(1, 3))
    s = draw(st.sampled_from([1, 1, 2, 4]))
    cap = draw(st.sampled_from([64, 300, 1024, 4096]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    t = DTYPES[dtype]
    f = lambda *shape: rng.standard_normal(shape).astype(t)  # noqa: E731
    seqlens = rng.integers(s - 1, cap, b).astype(np.int32)
    x = dict(query=f(b, s, n * d), key=f(b, s, hkv * d), value=f(b, s, hkv * d),
             past_key=f(b, hkv, cap, d), past_value=f(b, hkv, cap, d), seqlens_k=seqlens)
    attrs = dict(num_heads=n, kv_num_heads=hkv, total_sequence_length=cap, shared_buffer=True)
    if draw(st.booleans()):
        attrs["local_window_size"] = draw(st.integers(1, cap))
    if draw(st.booleans()):
        attrs["softcap"] = 30.0
    if draw(st.booleans()):
        x["head_sink"] = f(n)
    if draw(st.booleans()):
        attrs["do_rotary"] = 1
        angles = rng.uniform(0, 2 * np.pi, (cap, d // 2))
        x["cos_cache"], x["sin_cache"] = np.cos(angles).astype(t), np.sin(angles).astype(t)
    if draw(st.booleans()):
        x["attention_bias"] = f(1, n, s, cap)
    for bi, length in enumerate(seqlens):  # never read past T_b
        x["past_key"][bi, :, length + 1:] = np.nan
        x["past_value"][bi, :, length + 1:] = np.nan
    if draw(st.booleans()):  # poison a spot the kernels read
        where = draw(st.sampled_from(["query", "past_key", "past_value"]))
        bi = int(rng.integers(0, b))
        if where == "query":
            x["query"][bi, 0, int(rng.integers(0, n * d))] = draw(st.sampled_from([np.nan, np.inf]))
        else:
            # A past row every query row of the step sees (causal, window), and not one the step's
            # new rows overwrite: [T_b - W, T_b - S).
            total = int(seqlens[bi]) + 1
            lo = max(0, total - attrs["local_window_size"]) if "local_window_size" in attrs else 0
            if lo < total - s:
                row = int(rng.integers(lo, total - s))
                x[where][bi, int(rng.integers(0, hkv)), row, 0] = np.nan
    return x, attrs, t


def _check_gqa(call):
    x, attrs, dtype = call
    run = lambda backend: jax.jit(functools.partial(  # noqa: E731
        ops.group_query_attention, backend=backend, **attrs))(**x)
    got, want = run("cuda"), run("reference")
    assert_close(np.asarray(got.output), np.asarray(want.output), dtype)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))


@GPU
@given(gqa_decode_calls())
def test_gqa_cuda_matches_the_reference(call):
    _check_gqa(call)


@pytest.mark.slow
@SLOW
@given(gqa_decode_calls())
def test_gqa_cuda_matches_the_reference_wide(call):
    _check_gqa(call)


@st.composite
def attention_decode_calls(draw):
    """(inputs, attributes, dtype) of an ai.onnx Attention step with a past (the decode engine for
    half types and its head sizes, the general kernel otherwise)."""
    dtype = draw(st.sampled_from(["float16", "bfloat16", "float32"]))
    d = draw(st.sampled_from([64, 128, 72]))
    hkv = draw(st.sampled_from([1, 2]))
    hq = hkv * draw(st.sampled_from([1, 4]))
    b = draw(st.integers(1, 2))
    s = draw(st.sampled_from([1, 3]))
    p = draw(st.sampled_from([5, 200, 1000]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    t = DTYPES[dtype]
    f = lambda *shape: rng.standard_normal(shape).astype(t)  # noqa: E731
    x = dict(Q=f(b, hq, s, d), K=f(b, hkv, s, d), V=f(b, hkv, s, d), past_key=f(b, hkv, p, d),
             past_value=f(b, hkv, p, d))
    attrs = {}
    if draw(st.booleans()):
        attrs["softcap"] = 20.0
    empty = False
    if draw(st.booleans()):
        x["attn_mask"] = rng.random((s, p + s)) < 0.8
        if draw(st.booleans()):
            x["attn_mask"][int(rng.integers(0, s))] = False  # a fully masked row: 0, even poisoned
            empty = True
    if draw(st.booleans()):  # no causal bound or window: every key is read
        # (V is left clean beside a fully masked row: the spec's 0 * NaN there is NaN, the CUDA
        # path's fully masked row is 0.)
        where = draw(st.sampled_from(["Q", "past_key"] + ([] if empty else ["past_value"])))
        idx = tuple(int(rng.integers(0, n)) for n in x[where].shape)
        x[where][idx] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return x, attrs, t


def _check_attention(call):
    x, attrs, dtype = call
    run = lambda backend: jax.jit(functools.partial(  # noqa: E731
        ops.attention, backend=backend, **attrs))(**x)
    assert_close(np.asarray(run("cuda").y), np.asarray(run("reference").y), dtype)


@GPU
@given(attention_decode_calls())
def test_attention_cuda_matches_the_reference(call):
    _check_attention(call)


@pytest.mark.slow
@SLOW
@given(attention_decode_calls())
def test_attention_cuda_matches_the_reference_wide(call):
    _check_attention(call)
