"""NaN and Inf through both operators, held to the oracles (issue 16: no silent zero rows).

The rule (docs/attention.md, "NaN and Inf"): a *fully masked* row (no visible key) gives 0; a
*poisoned* row (a NaN, or +inf, reaching its logits from Q, K, a float mask or bias) gives NaN, as
the spec's math does, never 0. ai.onnx Attention follows the ONNX reference evaluator (which
onnxruntime matches): a NaN in any key's K or in the mask poisons the row, hidden or not, and
0 * NaN from V reaches the output. GroupQueryAttention follows onnxruntime: rows past seqlens_k + 1
are never read.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator

from jax_onnx_attn import ops
from jax_onnx_attn.conformance import attention_model
from jax_onnx_attn.ops.reference import core
from jax_onnx_attn.testing import assert_close
from ort_gqa import run_ort

B, H, S, L, D = 2, 2, 3, 5, 8


def _attention_inputs(seed: int):
    rng = np.random.default_rng(seed)
    return {"Q": rng.standard_normal((B, H, S, D)).astype(np.float32),
            "K": rng.standard_normal((B, H, L, D)).astype(np.float32),
            "V": rng.standard_normal((B, H, L, D)).astype(np.float32)}


def _set(name, index, value):
    def edit(x):
        x[name][index] = value
    return edit


def _mask(kind):
    def edit(x):
        if kind == "bool_row_empty":
            m = np.ones((S, L), bool)
            m[1] = False                       # row 1 fully masked
            x["attn_mask"] = m
        elif kind == "float_nan":
            m = np.zeros((S, L), np.float32)
            m[2, 3] = np.nan                   # poisons row 2
            x["attn_mask"] = m
        elif kind == "float_neginf_hides_nan_k":
            m = np.zeros((S, L), np.float32)
            m[:, 4] = -np.inf
            x["attn_mask"] = m
            x["K"][0, 0, 4, 0] = np.nan        # hidden by -inf, still NaN + -inf = NaN (spec)
    return edit


ATTENTION_CASES = {
    "q_nan": ([_set("Q", (0, 1, 1, 2), np.nan)], {}),
    "k_nan_visible": ([_set("K", (1, 0, 0, 0), np.nan)], {}),
    "k_nan_causally_hidden": ([_set("K", (0, 0, 4, 1), np.nan)], {"is_causal": 1}),
    "k_pos_inf": ([_set("K", (0, 1, 2, 3), np.inf)], {}),
    "k_neg_inf_row": ([_set("K", (1, 1, 0, slice(None)), -np.inf)], {}),
    "v_nan": ([_set("V", (0, 0, 1, 5), np.nan)], {}),
    "v_inf_causally_hidden": ([_set("V", (1, 0, 4, 0), np.inf)], {"is_causal": 1}),
    "mask_nan": ([_mask("float_nan")], {}),
    "fully_masked_row_is_zero": ([_mask("bool_row_empty"), _set("K", (0, 0, 1, 0), np.nan)], {}),
    "neginf_mask_does_not_hide_nan": ([_mask("float_neginf_hides_nan_k")], {}),
    "softcap_nan": ([_set("Q", (1, 1, 0, 0), np.nan)], {"softcap": 5.0}),
}


def _oracles(inputs, attrs):
    model = attention_model(inputs, attrs, opset=23)
    ref = ReferenceEvaluator(model).run(None, inputs)[0]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return ref, sess.run(None, inputs)[0]


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_attention_nan_inf_as_the_reference_and_onnxruntime(name):
    edits, attrs = ATTENTION_CASES[name]
    inputs = _attention_inputs(sum(map(ord, name)))
    for edit in edits:
        edit(inputs)
    with np.errstate(all="ignore"):
        ref, ort_y = _oracles(inputs, attrs)
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(ort_y))  # the oracles agree
    got = np.asarray(ops.attention(**inputs, **attrs, opset=23, backend="reference").y)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg="NaN rows differ")
    assert_close(np.where(np.isnan(ref), 0, got), np.where(np.isnan(ref), 0, ref))
    if name == "fully_masked_row_is_zero":
        np.testing.assert_array_equal(got[:, :, 1], 0)
    else:
        assert np.isnan(ref).any(), "the case must poison a row"


GQA = dict(num_heads=4, kv_num_heads=2)
P = 8


def _gqa_inputs(seed: int):
    rng = np.random.default_rng(seed)
    n, hkv, d = GQA["num_heads"], GQA["kv_num_heads"], 16
    return dict(query=rng.standard_normal((2, 1, n * d)).astype(np.float32),
                key=rng.standard_normal((2, 1, hkv * d)).astype(np.float32),
                value=rng.standard_normal((2, 1, hkv * d)).astype(np.float32),
                past_key=rng.standard_normal((2, hkv, P, d)).astype(np.float32),
                past_value=rng.standard_normal((2, hkv, P, d)).astype(np.float32),
                seqlens_k=np.array([5, 3], np.int32), total_sequence_length=P)


GQA_CASES = {
    "query_nan": ([_set("query", (0, 0, 3), np.nan)], {}),
    "past_key_inf_visible": ([_set("past_key", (0, 1, 2, 0), np.inf)], {}),
    "past_key_neg_inf_row": ([_set("past_key", (1, 0, 1, slice(None)), -np.inf)], {}),
    "past_value_nan_out_of_window": ([_set("past_value", (0, 0, 1, 0), np.nan)],
                                     {"local_window_size": 2}),
    "past_nan_beyond_seqlens_is_never_read": (
        [_set("past_key", (0, 0, 7, 0), np.nan), _set("past_value", (0, 1, 7, 0), np.nan)], {}),
    "past_key_nan_out_of_window_is_masked": ([_set("past_key", (0, 0, 1, 0), np.nan)],
                                             {"local_window_size": 2}),
    "bias_nan": ([lambda x: x.update(attention_bias=np.where(
        np.arange(P) == 2, np.nan, 0).astype(np.float32).reshape(1, 1, 1, P))], {}),
}


@pytest.mark.parametrize("name", sorted(GQA_CASES))
def test_gqa_nan_inf_as_onnxruntime(name):
    edits, attrs = GQA_CASES[name]
    inputs = _gqa_inputs(sum(map(ord, name)))
    for edit in edits:
        edit(inputs)
    want = run_ort(inputs, shared_buffer=True, **GQA, **attrs)["output"]
    got = np.asarray(ops.group_query_attention(**inputs, **GQA, **attrs, shared_buffer=True,
                                               backend="reference").output)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN places differ")
    assert_close(np.where(np.isnan(want), 0, got), np.where(np.isnan(want), 0, want))


def test_gqa_fully_masked_row_is_zero_not_nan():
    """local_window_size 0 leaves no visible key: 0 (onnxruntime gives 0 or NaN by code path)."""
    inputs = _gqa_inputs(3)
    inputs["past_key"][:, :, 7] = np.nan  # beyond every row's length: never read
    got = np.asarray(ops.group_query_attention(**inputs, **GQA, local_window_size=0,
                                               shared_buffer=True).output)
    np.testing.assert_array_equal(got, 0)


@pytest.mark.parametrize("row, want", [
    ([-np.inf, -np.inf], [0.0, 0.0]),                 # fully masked: 0
    ([np.nan, 0.0], [np.nan, np.nan]),                # poisoned: NaN
    ([np.inf, 0.0], [np.nan, np.nan]),                # +inf: inf - inf = NaN, as exp/sum make it
    ([0.0, -np.inf], [1.0, 0.0]),
])
def test_softmax_rule(row, want):
    got = np.asarray(core.softmax(np.asarray([row], np.float32)))[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want))
    # with a sink: a fully masked row stays 0; a poisoned one NaN
    got = np.asarray(core.softmax(np.asarray([row], np.float32), sink=np.float32(0.5)))[0]
    assert np.isnan(got).any() == np.isnan(want).any()
