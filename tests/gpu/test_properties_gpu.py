"""Property-based tests (hypothesis) on the GPU: the CUDA backend of both operators against their
reference backend on random calls the kernels cover (decode / verify steps), NaN / Inf included.

    pytest -m gpu tests/gpu/test_properties_gpu.py                # 40 derandomised examples each
    JOA_HYPOTHESIS_EXAMPLES=500 pytest -m gpu tests/gpu/test_properties_gpu.py

A failing example found here is kept below as an `@example` regression case.
"""

from __future__ import annotations

import functools
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_onnx_attn import ops
from jax_onnx_attn.testing import assert_close

pytestmark = pytest.mark.gpu

SETTINGS = settings(max_examples=int(os.environ.get("JOA_HYPOTHESIS_EXAMPLES", "40")),
                    deadline=None, derandomize="JOA_HYPOTHESIS_EXAMPLES" not in os.environ,
                    database=None, suppress_health_check=list(HealthCheck))
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def _same(got, want, dtype):
    got, want = np.asarray(got).astype(np.float32), np.asarray(want).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN places")
    ok = ~np.isnan(want)
    assert_close(np.where(ok, got, 0), np.where(ok, want, 0), dtype)


@st.composite
def gqa_decode_calls(draw):
    dtype = draw(st.sampled_from(["float16", "bfloat16"]))
    d = draw(st.sampled_from([64, 128, 256]))
    hkv = draw(st.sampled_from([1, 2, 4]))
    n = hkv * draw(st.sampled_from([1, 2, 4, 8]))
    b = draw(st.integers(1, 3))
    s = draw(st.sampled_from([1, 1, 2, 4]))
    cap = draw(st.sampled_from([64, 300, 1024, 4096]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    t = DTYPES[dtype]
    f = lambda *shape: rng.standard_normal(shape).astype(t)
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
    if draw(st.booleans()):  # poison a visible spot
        where = draw(st.sampled_from(["query", "past_key", "past_value"]))
        bi = int(rng.integers(0, b))
        if where == "query":
            x["query"][bi, 0, int(rng.integers(0, n * d))] = draw(st.sampled_from([np.nan, np.inf]))
        else:
            # A cache row every query row of the step sees (causal, window): the spec's NaN rows
            # are then exactly the ones the kernels read (docs: hidden keys may be skipped).
            total = int(seqlens[bi]) + 1
            lo = max(0, total - attrs["local_window_size"]) if "local_window_size" in attrs else 0
            hi = total - s + 1
            if lo < hi:
                row = int(rng.integers(lo, hi))
                x[where][bi, int(rng.integers(0, hkv)), row, 0] = np.nan
    return x, attrs, t


@SETTINGS
@given(gqa_decode_calls())
def test_gqa_cuda_matches_reference(call):
    x, attrs, dtype = call
    run = lambda backend: jax.jit(functools.partial(ops.group_query_attention, backend=backend,
                                                    **attrs))(**x)
    got, want = run("cuda"), run("reference")
    _same(got.output, want.output, dtype)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))


@st.composite
def attention_decode_calls(draw):
    dtype = draw(st.sampled_from(["float16", "bfloat16", "float32"]))
    d = draw(st.sampled_from([64, 128, 72]))
    hkv = draw(st.sampled_from([1, 2]))
    hq = hkv * draw(st.sampled_from([1, 4]))
    b = draw(st.integers(1, 2))
    s = draw(st.sampled_from([1, 3]))
    p = draw(st.sampled_from([5, 200, 1000]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    t = DTYPES[dtype]
    f = lambda *shape: rng.standard_normal(shape).astype(t)
    x = dict(Q=f(b, hq, s, d), K=f(b, hkv, s, d), V=f(b, hkv, s, d), past_key=f(b, hkv, p, d),
             past_value=f(b, hkv, p, d))
    attrs = {}
    if draw(st.booleans()):
        attrs["softcap"] = 20.0
    if draw(st.booleans()):
        x["attn_mask"] = rng.random((s, p + s)) < 0.8
    if draw(st.booleans()):
        where = draw(st.sampled_from(["Q", "past_key", "past_value"]))
        idx = tuple(int(rng.integers(0, n)) for n in x[where].shape)
        x[where][idx] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        x.pop("attn_mask", None)  # every key visible to every row: the spec's NaN rows are read
    return x, attrs, t


@SETTINGS
@given(attention_decode_calls())
def test_attention_cuda_matches_reference(call):
    x, attrs, dtype = call
    run = lambda backend: jax.jit(functools.partial(ops.attention, backend=backend, **attrs))(**x)
    _same(run("cuda").y, run("reference").y, dtype)
