"""GroupQueryAttention input validation: trace-time errors that name the input, the same rejections
as onnxruntime where it has the rule, and the device-side status for lengths only the device sees."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_onnx_attn.ops import group_query_attention, status
from jax_onnx_attn.testing import assert_close
from ort_gqa import ort_error, ort_has_input, run_ort

N, HKV, D, B, S, P = 4, 2, 16, 2, 4, 8


def _base(**changes):
    """A valid decode-free first prompt with every optional input the rule may need."""
    rng = np.random.default_rng(0)
    x = dict(query=rng.standard_normal((B, S, N * D)).astype(np.float32),
             key=rng.standard_normal((B, S, HKV * D)).astype(np.float32),
             value=rng.standard_normal((B, S, HKV * D)).astype(np.float32),
             seqlens_k=np.full(B, S - 1, np.int32), total_sequence_length=S)
    x.update(changes)
    return {k: v for k, v in x.items() if v is not None}


def _past(dtype=np.float32, length=P, d=D):
    return np.zeros((B, HKV, length, d), dtype)


def _cos(rows=S, cols=D // 2, dtype=np.float32):
    return np.ones((rows, cols), dtype)


A = dict(num_heads=N, kv_num_heads=HKV)
QUANT = dict(k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=8)
SCALES = dict(k_scale=np.ones(1, np.float32), v_scale=np.ones(1, np.float32))

# (id, inputs, attributes, the input named in our error, error type, onnxruntime rejects it too)
CASES = [
    ("query-2d", _base(query=np.zeros((B, N * D), np.float32)), A, "query", ValueError, True),
    ("query-int", _base(query=np.zeros((B, S, N * D), np.int32)), A, "query", TypeError, True),
    ("heads-not-divisible", _base(), dict(num_heads=4, kv_num_heads=3), "num_heads", ValueError, True),
    ("kv-heads-zero", _base(), dict(num_heads=4, kv_num_heads=0), "kv_num_heads", ValueError, True),
    ("head-size-not-multiple-of-8",
     _base(query=np.zeros((B, S, N * 12), np.float32), key=np.zeros((B, S, HKV * 12), np.float32),
           value=np.zeros((B, S, HKV * 12), np.float32)), A, "query", ValueError, True),
    ("query-no-tokens", _base(query=np.zeros((B, 0, N * D), np.float32),
                              key=np.zeros((B, 0, HKV * D), np.float32),
                              value=np.zeros((B, 0, HKV * D), np.float32)), A, "query",
     ValueError, True),
    ("head-size-zero", _base(query=np.zeros((B, S, 0), np.float32),
                             key=np.zeros((B, S, 0), np.float32),
                             value=np.zeros((B, S, 0), np.float32)), A, "query", ValueError,
     None),  # onnxruntime 1.32 dies of SIGFPE on it (a division by the head size)
    ("packed-hidden", _base(query=np.zeros((B, S, 100), np.float32), key=None, value=None), A,
     "query", ValueError, True),
    ("value-missing", _base(value=None), A, "value", ValueError, True),
    ("key-batch", _base(key=np.zeros((B + 1, S, HKV * D), np.float32)), A, "key", ValueError, True),
    ("key-seq", _base(key=np.zeros((B, S - 1, HKV * D), np.float32)), A, "key", ValueError, True),
    ("value-hidden", _base(value=np.zeros((B, S, HKV * D + 8), np.float32)), A, "value", ValueError, True),
    ("key-dtype", _base(key=np.zeros((B, S, HKV * D), np.float16)), A, "key", TypeError, True),
    ("past-value-missing", _base(past_key=_past()), A, "past_value", ValueError, True),
    ("past-3d", _base(past_key=np.zeros((B, HKV, P), np.float32),
                      past_value=np.zeros((B, HKV, P), np.float32)), A, "past_key", ValueError, True),
    ("past-heads", _base(past_key=np.zeros((B, HKV + 1, P, D), np.float32),
                         past_value=np.zeros((B, HKV + 1, P, D), np.float32)), A, "past_key",
     ValueError, True),
    ("past-head-size", _base(past_key=_past(d=D * 2), past_value=_past(d=D * 2)), A, "past_key",
     ValueError, True),
    ("past-lengths-differ", _base(past_key=_past(), past_value=_past(length=P + 1)), A,
     "past_value", ValueError, True),
    # onnxruntime 1.32 takes a float cache of another type than T; we keep the cache in T.
    ("past-dtype", _base(past_key=_past(np.float16), past_value=_past(np.float16)), A, "past_key",
     TypeError, None),
    ("seqlens-shape", _base(seqlens_k=np.zeros(B + 1, np.int32)), A, "seqlens_k", ValueError, True),
    ("seqlens-float", _base(seqlens_k=np.zeros(B, np.float32)), A, "seqlens_k", TypeError, True),
    ("total-two-elements", _base(total_sequence_length=np.array([S, S], np.int32)), A,
     "total_sequence_length", ValueError, True),
    ("total-below-S", _base(total_sequence_length=S - 1), A, "total_sequence_length", ValueError, True),
    ("total-neither-grow-nor-static",
     _base(query=np.zeros((B, 1, N * D), np.float32), key=np.zeros((B, 1, HKV * D), np.float32),
           value=np.zeros((B, 1, HKV * D), np.float32), past_key=_past(), past_value=_past(),
           total_sequence_length=P + 2), A, "total_sequence_length", ValueError, True),
    ("later-step-without-past", _base(total_sequence_length=S + 3), A, "past_key", ValueError, True),
    ("sin-missing", _base(cos_cache=_cos()), dict(A, do_rotary=1), "sin_cache", ValueError, True),
    ("rotary-without-cos", _base(), dict(A, do_rotary=1), "cos_cache", ValueError, True),
    ("rotary-head-size-24",
     _base(query=np.zeros((B, S, N * 24), np.float32), key=np.zeros((B, S, HKV * 24), np.float32),
           value=np.zeros((B, S, HKV * 24), np.float32), cos_cache=_cos(cols=8),
           sin_cache=_cos(cols=8)), dict(A, do_rotary=1), "cos_cache", ValueError, True),
    ("cos-rows-below-total", _base(cos_cache=_cos(rows=S - 1), sin_cache=_cos(rows=S - 1)),
     dict(A, do_rotary=1), "cos_cache", ValueError, True),
    ("cos-cols-above-half", _base(cos_cache=_cos(cols=D), sin_cache=_cos(cols=D)),
     dict(A, do_rotary=1), "cos_cache", ValueError, True),
    ("cos-cols-not-multiple-of-8", _base(cos_cache=_cos(cols=4), sin_cache=_cos(cols=4)),
     dict(A, do_rotary=1), "cos_cache", ValueError, True),
    ("sin-shape-differs", _base(cos_cache=_cos(), sin_cache=_cos(rows=S + 2)),
     dict(A, do_rotary=1), "sin_cache", ValueError, True),
    ("cos-dtype", _base(cos_cache=_cos(dtype=np.float16), sin_cache=_cos(dtype=np.float16)),
     dict(A, do_rotary=1), "cos_cache", TypeError, True),
    ("position-ids-shape", _base(cos_cache=_cos(rows=16), sin_cache=_cos(rows=16),
                                 position_ids=np.zeros((B, S + 1), np.int64)),
     dict(A, do_rotary=1), "position_ids", ValueError, None),  # onnxruntime reads [0, 0] only
    ("bias-width", _base(attention_bias=np.zeros((B, N, S, S + 1), np.float32)), A,
     "attention_bias", ValueError, True),
    ("bias-batch", _base(attention_bias=np.zeros((B + 1, N, S, S), np.float32)), A,
     "attention_bias", ValueError, True),
    ("bias-3d", _base(attention_bias=np.zeros((N, S, S), np.float32)), A, "attention_bias",
     ValueError, True),
    ("head-sink-shape", _base(head_sink=np.zeros(N + 1, np.float32)), A, "head_sink", ValueError, True),
    ("head-sink-dtype", _base(head_sink=np.zeros(N, np.float16)), A, "head_sink", TypeError, True),
    ("window-with-causal-0", _base(), dict(A, causal=0, local_window_size=2), "local_window_size",
     ValueError, True),
    ("quant-type-unknown", _base(past_key=_past(np.int8), past_value=_past(np.int8), **SCALES),
     dict(A, k_quant_type="PER_ROW", v_quant_type="PER_ROW", kv_cache_bit_width=8),
     "k_quant_type", ValueError, True),
    ("quant-types-differ", _base(past_key=_past(np.int8), past_value=_past(np.int8), **SCALES),
     dict(A, k_quant_type="PER_TENSOR", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8),
     "v_quant_type", ValueError, True),
    ("quant-bit-width", _base(past_key=_past(np.int8), past_value=_past(np.int8), **SCALES),
     dict(A, **dict(QUANT, kv_cache_bit_width=2)), "kv_cache_bit_width", ValueError, True),
    ("quant-scale-missing", _base(past_key=_past(np.int8), past_value=_past(np.int8),
                                  k_scale=np.ones(1, np.float32)), dict(A, **QUANT), "v_scale",
     ValueError, True),
    ("quant-per-channel-scale-size",
     _base(past_key=_past(np.int8), past_value=_past(np.int8), k_scale=np.ones(D, np.float32),
           v_scale=np.ones(D, np.float32)),
     dict(A, k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8),
     "k_scale", ValueError, True),
    ("quant-int4-in-int8-cache", _base(past_key=_past(np.int8, d=D // 2),
                                       past_value=_past(np.int8, d=D // 2), **SCALES),
     dict(A, **dict(QUANT, kv_cache_bit_width=4)), "past_key", TypeError, True),
    ("quant-float-cache", _base(past_key=_past(), past_value=_past(), **SCALES), dict(A, **QUANT),
     "past_key", TypeError, True),
    ("sliding-without-window", _base(past_key=_past(), past_value=_past()),
     dict(A, sliding_window_cache=1), "local_window_size", ValueError, True),
    ("sliding-capacity-below-window", _base(past_key=_past(length=3), past_value=_past(length=3)),
     dict(A, sliding_window_cache=1, local_window_size=4), "past_key", ValueError, True),
    ("qk-output-3", _base(), dict(A, qk_output=3), "qk_output", ValueError, True),
    # q/k norm: onnxruntime's CPU kernel rejects the inputs altogether (no shared rule to mirror).
    ("k-norm-missing", _base(q_norm_weight=np.ones(D, np.float32)), A, "k_norm_weight", ValueError, None),
    ("q-norm-shape", _base(q_norm_weight=np.ones(D + 8, np.float32),
                           k_norm_weight=np.ones(D + 8, np.float32)), A, "q_norm_weight", ValueError, None),
    ("qk-norm-epsilon", _base(), dict(A, qk_norm_epsilon=-1.0), "qk_norm_epsilon", ValueError, None),
    # Rules of our own API (no onnxruntime counterpart).
    ("kv-shared-without-past", _base(key=np.zeros((B, 0, HKV * D), np.float32),
                                     value=np.zeros((B, 0, HKV * D), np.float32)), A, "past_key",
     ValueError, None),
]


@pytest.mark.parametrize("inputs,attrs,name,exc,ort_rejects", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_invalid_input_raises_naming_it(inputs, attrs, name, exc, ort_rejects):
    with pytest.raises(exc, match=f"^group_query_attention: {name}: "):
        group_query_attention(**inputs, **attrs)
    if ort_rejects:
        assert ort_error(inputs, **attrs) is not None, "onnxruntime accepted what we reject"


def test_valid_base_runs_on_both():
    """The unmodified inputs of the error cases are valid for both (so each case tests one rule)."""
    inputs = _base()
    assert ort_error(inputs, **A) is None
    group_query_attention(**inputs, **A)


def test_shared_buffer_needs_past():
    with pytest.raises(ValueError, match="^group_query_attention: past_key: .*shared_buffer"):
        group_query_attention(**_base(), **A, shared_buffer=True)


def test_traced_total_sequence_length_is_derived_and_checked_on_the_device():
    """A traced total_sequence_length (a graph input under a user's jit) works: the shapes it sets
    are derived from the other inputs and its value is checked on the device (status)."""
    inputs = _base()
    total = inputs.pop("total_sequence_length")

    def step(total):
        res = group_query_attention(**inputs, total_sequence_length=total, **A)
        return res.output, res.present_key, res.status

    want = group_query_attention(**inputs, total_sequence_length=total, **A)
    out, present, stat = jax.jit(step)(np.int32(total))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want.output))
    np.testing.assert_array_equal(np.asarray(present), np.asarray(want.present_key))
    np.testing.assert_array_equal(np.asarray(stat), 0)
    # A value that breaks onnxruntime's rule (neither S, P + S nor <= P) is flagged on every row.
    _, _, stat = jax.jit(step)(np.int32(total + 3))
    np.testing.assert_array_equal(np.asarray(stat), status.TOTAL_SEQUENCE_LENGTH_INVALID)
    # A concrete array is read at trace time, also as a jit constant.
    concrete = jax.numpy.asarray([total], jax.numpy.int32)
    got = jax.jit(lambda: group_query_attention(**inputs, total_sequence_length=concrete, **A).output)()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.output))


def _decode(seqlens, capacity=P):
    rng = np.random.default_rng(1)
    return dict(query=rng.standard_normal((B, 1, N * D)).astype(np.float32),
                key=rng.standard_normal((B, 1, HKV * D)).astype(np.float32),
                value=rng.standard_normal((B, 1, HKV * D)).astype(np.float32),
                past_key=rng.standard_normal((B, HKV, capacity, D)).astype(np.float32),
                past_value=rng.standard_normal((B, HKV, capacity, D)).astype(np.float32),
                seqlens_k=np.array(seqlens, np.int32), total_sequence_length=capacity)


@pytest.mark.parametrize("bad", [P, P + 5, -1])
def test_seqlens_beyond_capacity_is_skipped_and_flagged(bad):
    """seqlens_k is read on the device: a row that would write outside the cache is not written,
    outputs 0 and is flagged; the other rows are untouched by it (onnxruntime, reading it on the
    host, refuses the whole call)."""
    inputs = _decode([bad, 3])
    assert ort_error(inputs, **A) is not None
    arrays = {k: v for k, v in inputs.items() if k != "total_sequence_length"}
    out = jax.jit(lambda x: group_query_attention(**x, total_sequence_length=P, shared_buffer=True,
                                                  **A))(arrays)
    np.testing.assert_array_equal(np.asarray(out.status), [status.KV_WRITE_OUT_OF_RANGE, status.OK])
    np.testing.assert_array_equal(np.asarray(out.present_key)[0], inputs["past_key"][0])
    np.testing.assert_array_equal(np.asarray(out.present_value)[0], inputs["past_value"][0])
    np.testing.assert_array_equal(np.asarray(out.output)[0], 0)
    # Row 1 is what onnxruntime computes for it alone.
    alone = {k: (v[1:] if isinstance(v, np.ndarray) and v.ndim else v) for k, v in inputs.items()}
    ref = run_ort(alone, shared_buffer=True, **A)
    assert_close(np.asarray(out.output)[1:], ref["output"], np.float32)
    np.testing.assert_array_equal(np.asarray(out.present_key)[1:], ref["present_key"])
    with pytest.raises(RuntimeError, match="batch 0: KV write out of range"):
        status.check(out.status)


def test_chunk_longer_than_its_row_is_flagged():
    """A multi-token step needs T_b >= S (past_b = T_b - S >= 0); the device flags a row that has not."""
    rng = np.random.default_rng(2)
    s = 3
    inputs = dict(query=rng.standard_normal((B, s, N * D)).astype(np.float32),
                  key=rng.standard_normal((B, s, HKV * D)).astype(np.float32),
                  value=rng.standard_normal((B, s, HKV * D)).astype(np.float32),
                  past_key=_past(), past_value=_past(), seqlens_k=np.array([5, 1], np.int32),
                  total_sequence_length=P)
    out = group_query_attention(**inputs, shared_buffer=True, **A)
    np.testing.assert_array_equal(np.asarray(out.status), [status.OK, status.KV_WRITE_OUT_OF_RANGE])
    np.testing.assert_array_equal(np.asarray(out.output)[1], 0)
    np.testing.assert_array_equal(np.asarray(out.present_key)[1], 0)
    one = {k: (v[1:] if isinstance(v, np.ndarray) and v.ndim else v) for k, v in inputs.items()}
    assert ort_error(one, **A) is not None


@pytest.mark.parametrize("mode", [
    "sliding_window_cache",
    pytest.param("query_seqlens", marks=pytest.mark.skipif(
        not ort_has_input("query_seqlens"), reason="onnxruntime < 1.32: no query_seqlens"))])
def test_device_lengths_refused_in_window_and_padded_chunks(mode):
    """Row 1's lengths are impossible (a window chunk longer than its row; more valid tokens than
    the chunk has): it is refused and flagged, row 0 runs as onnxruntime runs it alone."""
    rng = np.random.default_rng(3)
    s = 3
    inputs = dict(query=rng.standard_normal((B, s, N * D)).astype(np.float32),
                  key=rng.standard_normal((B, s, HKV * D)).astype(np.float32),
                  value=rng.standard_normal((B, s, HKV * D)).astype(np.float32),
                  past_key=rng.standard_normal((B, HKV, P, D)).astype(np.float32),
                  past_value=rng.standard_normal((B, HKV, P, D)).astype(np.float32),
                  total_sequence_length=20)
    attrs = dict(A)
    if mode == "sliding_window_cache":
        attrs.update(sliding_window_cache=1, local_window_size=4)
        inputs["seqlens_k"] = np.array([12, 1], np.int32)           # row 1: T_b = 2 < S
    else:
        inputs["total_sequence_length"] = P
        inputs["seqlens_k"] = np.array([5, 6], np.int32)
        inputs["query_seqlens"] = np.array([2, s + 1], np.int32)    # row 1: more than S
    out = group_query_attention(**inputs, shared_buffer=True, **attrs)
    np.testing.assert_array_equal(np.asarray(out.status), [status.OK, status.KV_WRITE_OUT_OF_RANGE])
    np.testing.assert_array_equal(np.asarray(out.output)[1], 0)
    np.testing.assert_array_equal(np.asarray(out.present_key)[1], inputs["past_key"][1])
    alone = {k: (v[:1] if isinstance(v, np.ndarray) and v.ndim else v) for k, v in inputs.items()}
    ref = run_ort(alone, shared_buffer=True, **attrs)
    rows = 2 if mode == "query_seqlens" else s       # padded query rows are unspecified
    assert_close(np.asarray(out.output)[:1, :rows], ref["output"][:, :rows], np.float32)


def test_cuda_backend_refuses_what_it_does_not_cover():
    """A first prompt runs on the reference: backend="cuda" says why it cannot take it, and
    "auto" gives the reference's result."""
    with pytest.raises(NotImplementedError, match="group_query_attention: backend='cuda'"):
        group_query_attention(**_base(), **A, backend="cuda")
    auto = group_query_attention(**_base(), **A, backend="auto")
    ref = group_query_attention(**_base(), **A, backend="reference")
    np.testing.assert_array_equal(np.asarray(auto.output), np.asarray(ref.output))
