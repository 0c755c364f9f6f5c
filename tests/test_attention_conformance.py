"""ops.attention (jitted, reference backend on CPU) against the ONNX backend node cases of Attention.

The cases are generated at run time by the installed onnx (`jax_onnx_attn.conformance`); nothing is
copied. Every output each case checks (Y, present_key/value, qk_matmul_output) must match within the
tolerance of its dtype from `jax_onnx_attn.testing`.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
import onnx
import pytest

from jax_onnx_attn import conformance, ops
from jax_onnx_attn.testing import assert_close

STATIC = ("is_causal", "scale", "softcap", "q_num_heads", "kv_num_heads", "qk_matmul_output_mode",
          "softmax_precision", "left_window_size", "right_window_size", "opset", "return_qk")
# One jitted function for every case: cases that share shapes and attributes share an executable.
_attention = jax.jit(ops.attention, static_argnames=STATIC)

BASE_CASES = [c.name for c in conformance.attention_cases(expanded=False)]
PREFIX = "test_attention_"


@pytest.mark.parametrize("name", BASE_CASES, ids=[n.removeprefix(PREFIX) for n in BASE_CASES])
def test_node_case(name):
    case = conformance.attention_case(name)
    arrays, attributes, produced = conformance.node_call(case)
    result = _attention(**arrays, **attributes, opset=case.opset,
                        return_qk="qk_matmul_output" in produced)
    got = dict(zip(conformance.ATTENTION_OUTPUTS, result))
    for (graph_name, expected), slot in zip(case.outputs.items(), produced):
        actual = np.asarray(got[slot])
        assert actual.shape == expected.shape, f"{slot}: shape {actual.shape} != {expected.shape}"
        assert actual.dtype == expected.dtype, f"{slot}: dtype {actual.dtype} != {expected.dtype}"
        assert_close(actual, expected, err_msg=f"{name}: {slot}")


def test_case_inventory():
    """Base and `_expanded` cases come in pairs with the same data; onnx 1.23.x makes 93 + 93."""
    cases = conformance.attention_cases()
    base = {c.name: c for c in cases if not c.expanded}
    twins = {c.base_name: c for c in cases if c.expanded}
    assert set(base) == set(twins)
    for name, case in base.items():
        twin = twins[name]
        assert twin.opset == case.opset
        assert list(twin.inputs) == list(case.inputs) and list(twin.outputs) == list(case.outputs)
        for key in case.outputs:
            np.testing.assert_array_equal(twin.outputs[key], case.outputs[key])
        assert [n.op_type for n in case.model.graph.node] == ["Attention"]
        assert "Attention" not in {n.op_type for n in twin.model.graph.node}
    if onnx.__version__.startswith("1.23."):
        assert len(base) == 93 and len(cases) == 186
        assert collections.Counter(c.opset for c in base.values()) == {23: 69, 24: 13, 25: 11}
    # Generated once per process: a second call returns the very same objects.
    assert conformance.attention_cases() is cases


def test_save_cases_round_trip(tmp_path):
    """The on-disk layout (model.onnx + test_data_set_0/*.pb) reloads to the same case."""
    case = conformance.attention_case("4d_gqa_with_past_and_present_fp16")
    root, = conformance.save_cases(tmp_path, [case])
    model = onnx.load(f"{root}/model.onnx")
    assert [i.name for i in model.graph.input] == list(case.inputs)
    for prefix, arrays in (("input", case.inputs), ("output", case.outputs)):
        for i, expected in enumerate(arrays.values()):
            loaded = onnx.numpy_helper.to_array(
                onnx.load_tensor(f"{root}/test_data_set_0/{prefix}_{i}.pb"))
            np.testing.assert_array_equal(loaded, expected)
